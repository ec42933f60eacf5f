"""Where a prefill's GPU time goes: one ``generate`` of a prompt of L tokens (no store), under torch's profiler, the
operators with the most device time, and the time per chunk beside it.

    python3 dev/profile_prefill.py CHECKPOINT [--tokens 32768] [--chunk-tokens 2048] [--top 25]

Run on the lent GPU from the repository root (as ``dev/gpu_ttft.py --profile`` does, with its bundle on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvtier.engine import Engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(
        args.checkpoint,
        device="cuda",
        dtype=torch.bfloat16,
        cache_tokens=args.tokens + 1024,
        chunk_tokens=args.chunk_tokens,
    )
    prompt = torch.randint(0, engine.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    engine.generate([prompt.tolist()[:4096]], 1, reuse=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate([prompt.tolist()], 1, reuse=False)
    torch.cuda.synchronize()
    plain = time.perf_counter() - start
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        engine.generate([prompt.tolist()], 1, reuse=False)
        torch.cuda.synchronize()
    chunks = -(-args.tokens // args.chunk_tokens)
    per_chunk = plain / chunks * 1e3
    print(f"prefill of {args.tokens} tokens: {plain * 1e3:.1f} ms ({per_chunk:.1f} ms a chunk of {args.chunk_tokens})")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
