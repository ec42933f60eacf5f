"""TTFT through ``kvtier-engine serve`` against the engine API's, for the same prompts and store, in one run.

    python benchmarks/serve_ttft_bench.py [--checkpoint DIR | --preset tiny [--context N]] [--device cpu]
        [--dtype float32] [--prompt-tokens 32768,77824] [--hit 96] [--repeats 3] [--chunk-tokens 512]
        [--cache-tokens N] [--node-capacity 2GiB] [--data-dir DIR] [--threads 1] [--settle-s 2] [--json]

A temporary cluster of 12 node processes (data in a temporary folder under ``--data-dir``; ``/dev/shm`` on the GPU
host, as ``dev/gpu_ttft.py`` uses), the server (embedded engine, the same device, dtype, chunk and cache sizes) and an
engine in this process on the same store. For every prompt length and repeat, each way gets a fresh random
prompt of token ids whose first ``hit`` % (rounded down to a multiple of 128) it has just prefilled (so the store
holds the blocks and its own StateBlock pool the state): the server through ``/v1/completions`` (the prefix with
``max_tokens`` 1, then ``--settle-s`` for its blocks to be put: the server puts them after it answers, the engine
before ``generate`` returns), the engine through ``generate``. Then the whole prompt, a warm repeat of its prefix:

- **serve**: a streaming ``/v1/completions`` with the token ids (``max_tokens`` 16, ``ignore_eos``), TTFT from
  the request's first byte to the first chunk (the server sends the first token's at once), on the client;
- **engine**: ``engine.generate([prompt], 1)``, TTFT from the call to its return (``wall``) and the engine's
  own ``ttft_s`` (prefill start to first token).

The two ways alternate which goes first. Reported per length: medians of both, ``serve / engine`` (against the
wall time: the API call a Python user makes) and the parts of the server's TTFT its engine saw (``ttft_s``).
Target (issue 34): serve / engine ≤ 1.15 on the GPU at 32K and 77K tokens. A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from kvtier.engine.checkpoint import DTYPES, make_checkpoint
from kvtier.engine.engine import Engine
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.units import parse_size
from kvtier.tools.benchutil import start_serve
from kvtier.tools.kvbench.common import stop_process


def start_server(checkpoint: Path, store: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    options = ["--checkpoint", str(checkpoint), "--store", str(store), "--served-model-name", "m", "--device",
               args.device, "--dtype", args.dtype, "--chunk-tokens", str(args.chunk_tokens), "--cache-tokens",
               str(args.cache_tokens), "--threads", str(args.threads), "--disable-access-log"]  # fmt: skip
    return start_serve(options, "serve_ttft_bench", timeout_s=900, stdout=sys.stderr)


def through_serve(http: httpx.Client, url: str, prompt: list[int]) -> float:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()  # fmt: skip
    began = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):  # the first token's chunk (sent at once, even with no text yet)
                return time.perf_counter() - began
    raise RuntimeError("the stream ended without text")


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-ttft-", dir=args.data_dir) as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else make_checkpoint(Path(tmp) / "ck", args.preset)
        if args.context and not args.checkpoint:
            config = json.loads((checkpoint / "config.json").read_text())
            config["max_position_embeddings"] = args.context
            (checkpoint / "config.json").write_text(json.dumps(config))
        path = cluster_mod.write_default(Path(tmp) / "cluster", capacity_bytes=parse_size(args.node_capacity),
                                         metrics=False)  # fmt: skip
        with LocalCluster(path) as local:
            proc, url = start_server(checkpoint, local.config_path, args)
            engine = Engine.from_pretrained(checkpoint, args.device, DTYPES[args.dtype], store=local.config_path,
                                            cache_tokens=args.cache_tokens, chunk_tokens=args.chunk_tokens)  # fmt: skip
            vocab = engine.config.vocab_size
            try:
                with httpx.Client(timeout=900) as http:
                    for length in lengths:
                        h = min(length * args.hit // 100 // 128 * 128, length - 134)
                        serve_s, wall_s, engine_ttft_s = [], [], []
                        for rep in range(args.repeats):
                            for way in ("serve", "engine") if rep % 2 == 0 else ("engine", "serve"):
                                prompt = rng.integers(5, vocab, length).tolist()
                                if way == "serve":
                                    http.post(
                                        url + "/v1/completions",
                                        json={"model": "m", "prompt": prompt[:h], "max_tokens": 1},
                                    ).raise_for_status()
                                    time.sleep(args.settle_s)  # its blocks are put after its answer
                                    serve_s.append(through_serve(http, url, prompt))
                                else:
                                    engine.generate([prompt[:h]], 1)
                                    began = time.perf_counter()
                                    [result] = engine.generate([prompt], 1)
                                    wall_s.append(time.perf_counter() - began)
                                    engine_ttft_s.append(result.ttft_s)
                        serve, wall = statistics.median(serve_s), statistics.median(wall_s)
                        rows.append({"prompt_tokens": length, "hit_tokens": h, "serve_ms": serve * 1e3,
                                     "engine_wall_ms": wall * 1e3,
                                     "engine_ttft_ms": statistics.median(engine_ttft_s) * 1e3,
                                     "serve_over_engine": serve / wall, "serve_runs_ms": [x * 1e3 for x in serve_s],
                                     "engine_runs_ms": [x * 1e3 for x in wall_s]})  # fmt: skip
            finally:
                engine.close()
                stop_process(proc, timeout_s=120)
    return {"device": args.device, "dtype": args.dtype, "chunk_tokens": args.chunk_tokens, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a Hugging Face directory (default: a --preset checkpoint, seed 0)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--context", type=int, help="the preset's max_position_embeddings (to reach long prompts)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--prompt-tokens", default="32768,77824")
    parser.add_argument("--hit", type=int, default=96, help="percent of the prompt prefilled before (default 96)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--cache-tokens", type=int, default=1 << 17)
    parser.add_argument("--node-capacity", default="2GiB")
    parser.add_argument("--data-dir", help="where the cluster's data and the checkpoint go (e.g. /dev/shm)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--settle-s", type=float, default=2.0, help="pause after a prefix, for its put (default 2)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"TTFT through serve vs the engine API, {args.device} {args.dtype}, hit {args.hit} %, medians of "
          f"{args.repeats}")  # fmt: skip
    print(f"{'L':>7} {'serve ms':>9} {'engine ms':>10} {'(ttft_s)':>9} {'serve/engine':>13}")
    for r in result["rows"]:
        print(f"{r['prompt_tokens']:>7} {r['serve_ms']:>9.1f} {r['engine_wall_ms']:>10.1f} "
              f"{r['engine_ttft_ms']:>9.1f} {r['serve_over_engine']:>13.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
