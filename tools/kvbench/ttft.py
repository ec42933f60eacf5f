"""``kvbench ttft``: time to first token against the prefix hit ratio, with and without reuse.

    kvbench [--config PATH] ttft [--checkpoint DIR | --preset tiny] [--prompt-tokens 4000] [--hits 0,50,90,96]
                                 [--repeats 3] [--threads 1] [--device cpu] [--through client|fetcher] [--json]

A real cluster (``--config``, or a temporary local one of 12 node processes) and the engine in this process.
``--through fetcher`` starts a ``kvtier-fetcher`` for the run and moves blocks through its shared-memory pool
(blocks the prefix run put are then host-memory hits); ``client`` reads them from the nodes.
For every hit ratio ``r`` and repeat: a fresh random prompt of ``L`` tokens; its first ``h`` tokens (``r·L``
rounded to a multiple of 128, at most ``L − 134``) are prefilled once so the store holds their blocks and the
StateBlock at ``h``; then, alternately, TTFT **without reuse** (``reuse=False``: full prefill) and **with
reuse** (exact: ``h`` tokens fetched, ``L − h`` computed). Medians over the repeats.

Beside each point its **bound**: the hit bytes at the store's ``get_into`` rate measured in the same run
(whole prefixes of page-sized blocks into preallocated buffers) plus that run's own suffix compute time.
Reported: TTFT with and without reuse, ``speedup`` (the median over repeats of without / with, each pair
measured back to back, so that load from other processes cancels) and ``vs_bound`` (with / bound).
Targets: ``vs_bound`` ≤ 1.25; at 96 % on the CPU, ``speedup`` ≥ 10.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import BenchError, UsageError
from kvtier.tools.kvbench.enginebench import add_model_arguments, checkpoint_and_cluster, describe
from kvtier.transfer.fetcher import LocalFetcher

if TYPE_CHECKING:  # the engine needs torch; kvbench's other commands must run without it
    from kvtier.engine.engine import Engine


def register(commands: Subcommands) -> None:
    p = commands.add("ttft", "engine time to first token against prefix hit ratio, with and without reuse", run)
    add_model_arguments(p)
    p.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length L (default 4000)")
    p.add_argument("--hits", default="0,50,90,96", help="hit ratios in percent (default 0,50,90,96)")
    p.add_argument("--repeats", type=int, default=3, help="prompts per hit ratio (default 3)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--through",
        choices=["client", "fetcher"],
        default="client",
        help="move blocks with the store client, or through a fetcher process started for the run (its pool)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        hits = [float(h) for h in args.hits.split(",")]
    except ValueError:
        raise UsageError(f"--hits takes comma-separated percentages, got {args.hits!r}") from None
    if not all(0 <= h < 100 for h in hits) or args.prompt_tokens < 135 or min(args.repeats, args.threads) < 1:
        raise UsageError("--hits in [0, 100), --prompt-tokens ≥ 135, --repeats and --threads ≥ 1")
    import torch

    from kvtier.engine.engine import Engine

    with checkpoint_and_cluster(args, "kvbench-ttft-") as (checkpoint, config, scratch):
        fetcher = None
        if args.through == "fetcher":
            shm = f"kvbench-ttft-{secrets.token_hex(4)}"
            fetcher = LocalFetcher(config, shm, scratch / "fetcher.sock", "1GiB", "1MiB").start()
        try:
            engine = Engine.from_pretrained(
                checkpoint,
                device=args.device,
                dtype=getattr(torch, args.dtype),
                store=config,
                fetcher=fetcher.socket_path if fetcher else None,
                cache_tokens=2 * args.prompt_tokens + 1024,
            )
            result = _bench(engine, args.prompt_tokens, hits, args.repeats)
        finally:
            if fetcher is not None:
                fetcher.stop()
    result["settings"] = {
        "checkpoint": describe(args),
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "device": args.device,
        "block_tokens": engine.block_tokens,
        "block_bytes": engine.cache.page_bytes,
        "through": args.through,
    }
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


def hit_tokens(ratio: float, length: int) -> int:
    h = round(ratio / 100 * length / 128) * 128
    return min(h, (length - 134) // 128 * 128)


def _bench(engine: Engine, length: int, hits: list[float], repeats: int) -> dict[str, Any]:
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(0)
    engine.generate([rng.integers(0, vocab, length).tolist()], 1, reuse=False)  # warm-up
    points, prefixes = [], []
    for ratio in hits:
        h = hit_tokens(ratio, length)
        cold, warm, bound_compute = [], [], []
        for _ in range(repeats):
            prompt = rng.integers(0, vocab, length).tolist()
            if h:
                engine.generate([prompt[:h]], 1)
                prefixes.append(prompt[:h])
            cold.append(engine.generate([prompt], 1, reuse=False)[0].ttft_s)
            r = engine.generate([prompt], 1)[0]
            if r.hit_tokens != h or r.replayed:
                raise BenchError(f"expected an exact hit of {h} tokens, got {r.hit_tokens} (replayed={r.replayed})")
            warm.append(r.ttft_s)
            bound_compute.append(r.timings["compute_s"])
        points.append(
            {
                "hit_percent": ratio,
                "hit_tokens": h,
                "ttft_reuse_s": statistics.median(warm),
                "ttft_recompute_s": statistics.median(cold),
                "compute_s": statistics.median(bound_compute),
                "speedup": statistics.median(c / w for c, w in zip(cold, warm, strict=True)),
                "hit_bytes": h // engine.block_tokens * engine.cache.page_bytes,
            }
        )
    rate = _get_rate(engine, prefixes)
    for p in points:
        p["bound_s"] = p["hit_bytes"] / rate + p["compute_s"]
        p["vs_bound"] = p["ttft_reuse_s"] / p["bound_s"]
    return {"command": "ttft", "get_into_bytes_per_s": rate, "points": points}


def _get_rate(engine: Engine, prefixes: list[list[int]]) -> float:
    """The store's ``get_into`` rate for whole prefixes of page-sized blocks (median over the prefixes)."""
    store = engine.store
    assert store is not None
    if not prefixes:
        return float("inf")
    rates = []
    for prefix in prefixes:
        keys = store.keys(prefix)
        buffers = [memoryview(bytearray(engine.cache.page_bytes)) for _ in keys]
        start = time.perf_counter()
        got = store.get_into(keys, buffers, prefix)
        elapsed = time.perf_counter() - start
        if got != len(keys):
            raise BenchError(f"get_into found {got} of {len(keys)} blocks just stored")
        rates.append(len(keys) * engine.cache.page_bytes / elapsed)
    return statistics.median(rates)


def _text(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"TTFT, {s['checkpoint']}, L = {s['prompt_tokens']} tokens, {s['device']}, {s['threads']} thread(s), "
        f"blocks of {s['block_tokens']} tokens / {s['block_bytes']} B via the {s['through']}; "
        f"get_into {result['get_into_bytes_per_s'] / 1e6:.0f} MB/s; medians of {s['repeats']}",
        f"{'hit %':>6} {'hit tok':>8} {'reuse ms':>9} {'recompute ms':>13} {'speedup':>8} "
        f"{'bound ms':>9} {'vs bound':>9}",
    ]
    for p in result["points"]:
        lines.append(
            f"{p['hit_percent']:>6.0f} {p['hit_tokens']:>8} {p['ttft_reuse_s'] * 1e3:>9.1f} "
            f"{p['ttft_recompute_s'] * 1e3:>13.1f} {p['speedup']:>7.1f}x "
            f"{p['bound_s'] * 1e3:>9.1f} {p['vs_bound']:>9.2f}"
        )
    return "\n".join(lines)
