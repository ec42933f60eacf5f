"""Load test of ``kvtier-engine serve`` with a real client: the ``openai`` AsyncOpenAI client in an asyncio loop
against the tiny CPU checkpoint, at rising request rates.

    python benchmarks/serve_bench.py [--rates 0.5,1,2,4] [--duration 20] [--prefill 0 --decode 0]
                                     [--max-queued-requests 8] [--new-tokens 16] [--json]

Starts a local 12-node cluster, writes the tiny seed-0 checkpoint, starts the server (embedded, or with
``--prefill N --decode M`` worker processes) and, per rate, sends streaming completions with Poisson arrivals
for ``--duration`` seconds (bounded: at most ``rate × duration`` requests, each with a 300 s timeout). Prompts
are token ids: 24 conversations' turns sharing a 256-token system prompt, 100–700 tokens each, so repeats hit
the store. Every answer is checked against the single-process engine's greedy output for its prompt (computed
here first): nothing dropped (every request is answered, with text or a 429) or corrupted (every text equal).

Reports per rate: requests sent, answered, 429s, errors, mismatches; TTFT and inter-token latency p50/p99
(client side: first chunk, and the gaps between chunks); output tokens per second; reused prompt tokens. A
benchmark, never a test.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import torch

from kvtier.engine.checkpoint import make_checkpoint
from kvtier.engine.engine import Engine
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.serving.text import TextCodec
from kvtier.tools.benchutil import start_serve
from kvtier.tools.kvbench.common import stop_process


def prompts(vocab: int, n: int = 24, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(5, vocab, 256).tolist()
    out = []
    for _ in range(n):
        out.append(system + rng.integers(5, vocab, int(rng.integers(100, 450))).tolist())
    return out


def start_server(checkpoint: Path, cluster: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    options = ["--checkpoint", str(checkpoint), "--store", str(cluster), "--model", "tiny", "--prefill",
               str(args.prefill), "--decode", str(args.decode), "--max-queued-requests",
               str(args.max_queued_requests)]  # fmt: skip
    return start_serve(options, "serve_bench", timeout_s=300)


async def one(client: openai.AsyncOpenAI, prompt: list[int], expected: str, n: int) -> dict[str, Any]:
    start = time.perf_counter()
    stamps, text, usage = [], [], None
    try:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})  # fmt: skip
        async for chunk in stream:
            if chunk.choices:
                stamps.append(time.perf_counter())
                text.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.RateLimitError:
        return {"status": 429}
    except openai.APIError as e:
        return {"status": "error", "error": str(e)}
    got = "".join(text)
    return {
        "status": 200,
        "match": got == expected,
        "ttft_s": stamps[0] - start if stamps else float("nan"),
        "itl_s": [b - a for a, b in itertools.pairwise(stamps)],
        "tokens": usage.completion_tokens if usage else 0,
        "cached": usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0,
        "prompt_tokens": len(prompt),
    }


async def at_rate(url: str, rate: float, duration_s: float, cases: list[tuple[list[int], str]], n: int) -> dict:
    rng = random.Random(int(rate * 1000))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    tasks = []
    began = time.perf_counter()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        await asyncio.sleep(max(0.0, began + t - time.perf_counter()))
        prompt, expected = cases[rng.randrange(len(cases))]
        tasks.append(asyncio.create_task(one(client, prompt, expected, n)))
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - began
    await client.close()
    ok = [r for r in results if r["status"] == 200]
    ttft = [r["ttft_s"] for r in ok]
    itl = [x for r in ok for x in r["itl_s"]]

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    return {
        "rate": rate,
        "sent": len(results),
        "answered": len(ok),
        "rejected_429": sum(r["status"] == 429 for r in results),
        "errors": sum(r["status"] == "error" for r in results),
        "mismatches": sum(not r["match"] for r in ok),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
        "cached_share": sum(r["cached"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1,2,4", help="requests per second, one run each")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate (20)")
    parser.add_argument("--prefill", type=int, default=0)
    parser.add_argument("--decode", type=int, default=0)
    parser.add_argument("--max-queued-requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-bench-") as tmp:
        checkpoint = make_checkpoint(Path(tmp) / "tiny", "tiny", seed=0)
        codec = TextCodec(checkpoint)
        reference = Engine.from_pretrained(checkpoint)
        cases = [(p, codec.decode(reference.generate([p], args.new_tokens)[0].tokens))
                 for p in prompts(reference.config.vocab_size)]  # fmt: skip
        path = cluster_mod.write_default(Path(tmp) / "cluster", capacity_bytes=256 << 20, metrics=False)
        with LocalCluster(path) as local:
            proc, url = start_server(checkpoint, local.config_path, args)
            try:
                rows = [asyncio.run(at_rate(url, float(r), args.duration, cases, args.new_tokens))
                        for r in args.rates.split(",")]  # fmt: skip
            finally:
                stop_process(proc, timeout_s=120)
    mode = "embedded" if not args.prefill else f"{args.prefill} prefill + {args.decode} decode workers"
    if args.json:
        print(json.dumps({"mode": mode, "new_tokens": args.new_tokens, "rows": rows}, indent=2))
        return 0
    print(f"kvtier-engine serve, tiny checkpoint on CPU, {mode}, {args.new_tokens} tokens a request, "
          f"--max-queued-requests {args.max_queued_requests}")  # fmt: skip
    print(f"{'rate':>5} {'sent':>5} {'ok':>4} {'429':>4} {'err':>4} {'wrong':>5} {'TTFT p50':>9} {'p99':>8} "
          f"{'ITL p50':>8} {'p99':>8} {'tok/s':>6} {'reused':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['rate']:>5g} {r['sent']:>5} {r['answered']:>4} {r['rejected_429']:>4} {r['errors']:>4} "
              f"{r['mismatches']:>5} {r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p99_s'] * 1e3:>6.0f}ms "
              f"{r['itl_p50_s'] * 1e3:>6.1f}ms {r['itl_p99_s'] * 1e3:>6.1f}ms {r['output_tokens_per_s']:>6.1f} "
              f"{r['cached_share']:>6.0%}")  # fmt: skip
    return 0 if all(r["errors"] == 0 and r["mismatches"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
