"""``kvbench ttft``: time to first token against the prefix hit ratio, with and without reuse.

    kvbench [--config PATH] ttft [--checkpoint DIR | --preset tiny] [--prompt-tokens 4000[,L2…]] [--hits 0,50,90,96]
                                 [--repeats 3] [--threads 1] [--device cpu] [--dtype float32] [--chunk-tokens 512]
                                 [--through client|fetcher] [--pool 1GiB] [--node-capacity 2GiB]
                                 [--json] [--json-out FILE]

A real cluster (``--config``, or a temporary local one of 12 node processes of ``--node-capacity`` each) and the
engine in this process. ``--through fetcher`` starts a ``kvtier-fetcher`` (a pool of ``--pool``) for the run and
moves blocks through its shared-memory pool (blocks the prefix run put are then host-memory hits); ``client``
reads them from the nodes. For every prompt length ``L``, hit ratio ``r`` and repeat: a fresh random prompt of
``L`` tokens; its first ``h`` tokens (``r·L`` rounded to a multiple of 128, at most ``L − 134``) are prefilled
once so the store holds their blocks and the StateBlock at ``h``; then, alternately, TTFT **without reuse**
(``reuse=False``: full prefill) and **with reuse** (exact: ``h`` tokens fetched, ``L − h`` computed). Medians
over the repeats. On a GPU every time is taken after the device has finished (the engine synchronizes).

Beside each point its **bound**: the hit bytes at the store's ``get_into`` rate plus that run's own suffix
compute time. The rate is measured at each point right after its runs: the point's last prefix read whole (page-
sized blocks into touched host buffers), the faster of two reads. Reported: TTFT with and without reuse,
``speedup`` (the median over repeats of without / with, each pair measured back to back, so that load from other
processes cancels) and ``vs_bound`` (with / bound). Targets: ``vs_bound`` ≤ 1.25; at 96 % on the CPU,
``speedup`` ≥ 10.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
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
    p.add_argument("--prompt-tokens", default="4000", help="prompt lengths L, comma-separated (default 4000)")
    p.add_argument("--hits", default="0,50,90,96", help="hit ratios in percent (default 0,50,90,96)")
    p.add_argument("--repeats", type=int, default=3, help="prompts per hit ratio (default 3)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--chunk-tokens", type=int, default=512, help="queries per forward chunk (default 512)")
    p.add_argument(
        "--through",
        choices=["client", "fetcher"],
        default="client",
        help="move blocks with the store client, or through a fetcher process started for the run (its pool)",
    )
    p.add_argument("--pool", default="1GiB", help="the fetcher's pool with --through fetcher (default 1GiB)")
    p.add_argument("--json-out", type=Path, help="also write the JSON object to this file (after every length)")


def run(args: argparse.Namespace) -> int:
    try:
        hits = [float(h) for h in args.hits.split(",")]
        lengths = [int(n) for n in args.prompt_tokens.split(",")]
    except ValueError:
        raise UsageError(f"--hits and --prompt-tokens take comma-separated numbers, got {args.hits!r}, "
                         f"{args.prompt_tokens!r}") from None  # fmt: skip
    if not all(0 <= h < 100 for h in hits) or min(lengths) < 135 or min(args.repeats, args.threads) < 1:
        raise UsageError("--hits in [0, 100), --prompt-tokens ≥ 135, --repeats and --threads ≥ 1")
    import torch

    from kvtier.engine.engine import Engine

    result: dict[str, Any] = {"command": "ttft", "points": []}
    with checkpoint_and_cluster(args, "kvbench-ttft-") as (checkpoint, config, scratch):
        fetcher = None
        if args.through == "fetcher":
            shm = f"kvbench-ttft-{secrets.token_hex(4)}"
            fetcher = LocalFetcher(config, shm, scratch / "fetcher.sock", args.pool, "1MiB").start()
        try:
            engine = Engine.from_pretrained(
                checkpoint,
                device=args.device,
                dtype=getattr(torch, args.dtype),
                store=config,
                fetcher=fetcher.socket_path if fetcher else None,
                cache_tokens=2 * max(lengths) + 1024,
                chunk_tokens=args.chunk_tokens,
            )
            result["settings"] = {
                "checkpoint": describe(args),
                "prompt_tokens": lengths,
                "repeats": args.repeats,
                "threads": args.threads,
                "device": args.device,
                "dtype": args.dtype,
                "chunk_tokens": args.chunk_tokens,
                "block_tokens": engine.block_tokens,
                "block_bytes": engine.cache.page_bytes,
                "through": args.through,
            }
            for length in lengths:
                for point in _bench(engine, length, hits, args.repeats):
                    result["points"].append(point)
                    if args.json_out:  # after every point: a run cut short keeps what it measured
                        args.json_out.write_text(json.dumps(result, indent=2))
                if not args.json:
                    print(_text(result, length), flush=True)
        finally:
            if fetcher is not None:
                fetcher.stop()
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def hit_tokens(ratio: float, length: int) -> int:
    h = round(ratio / 100 * length / 128) * 128
    return min(h, (length - 134) // 128 * 128)


def _bench(engine: Engine, length: int, hits: list[float], repeats: int) -> Iterator[dict[str, Any]]:
    """One point per hit ratio, each as soon as it is measured."""
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(length)
    engine.generate([rng.integers(0, vocab, length).tolist()], 1, reuse=False)  # warm-up
    for ratio in hits:
        h = hit_tokens(ratio, length)
        cold, warm, bound_compute, fetch = [], [], [], []
        prefix: list[int] = []
        for _ in range(repeats):
            prompt = rng.integers(0, vocab, length).tolist()
            if h:
                engine.generate([prompt[:h]], 1)
                prefix = prompt[:h]
            cold.append(engine.generate([prompt], 1, reuse=False)[0].ttft_s)
            r = engine.generate([prompt], 1)[0]
            if r.hit_tokens != h or r.replayed:
                raise BenchError(f"expected an exact hit of {h} tokens, got {r.hit_tokens} (replayed={r.replayed})")
            warm.append(r.ttft_s)
            bound_compute.append(r.timings["compute_s"])
            fetch.append(r.timings["lookup_fetch_s"])
        rate = _get_rate(engine, prefix)
        hit_bytes = h // engine.block_tokens * engine.cache.page_bytes
        reuse_s, compute_s = statistics.median(warm), statistics.median(bound_compute)
        bound = hit_bytes / rate + compute_s if h else compute_s
        yield (
            {
                "prompt_tokens": length,
                "hit_percent": ratio,
                "hit_tokens": h,
                "ttft_reuse_s": reuse_s,
                "ttft_recompute_s": statistics.median(cold),
                "lookup_fetch_s": statistics.median(fetch),
                "compute_s": compute_s,
                "speedup": statistics.median(c / w for c, w in zip(cold, warm, strict=True)),
                "hit_bytes": hit_bytes,
                "get_into_bytes_per_s": rate if h else None,
                "bound_s": bound,
                "vs_bound": reuse_s / bound,
            }
        )


def _get_rate(engine: Engine, prefix: list[int]) -> float:
    """The store's ``get_into`` rate for ``prefix``'s blocks read whole into touched host buffers (the faster of
    two reads); inf for an empty prefix."""
    store = engine.store
    assert store is not None
    keys = store.keys(prefix)
    if not keys:
        return float("inf")
    buffers = np.ones((len(keys), engine.cache.page_bytes), dtype=np.uint8)
    views = [memoryview(row) for row in buffers]
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        got = store.get_into(keys, views, prefix)
        best = min(best, time.perf_counter() - start)
        if got != len(keys):
            raise BenchError(f"get_into found {got} of {len(keys)} blocks just stored")
    return len(keys) * engine.cache.page_bytes / best


def _text(result: dict[str, Any], length: int) -> str:
    s = result["settings"]
    lines = [
        f"TTFT, {s['checkpoint']}, L = {length} tokens, {s['device']} {s['dtype']}, {s['threads']} thread(s), "
        f"chunks of {s['chunk_tokens']}, blocks of {s['block_tokens']} tokens / {s['block_bytes']} B via the "
        f"{s['through']}; medians of {s['repeats']}",
        f"{'hit %':>6} {'hit tok':>8} {'reuse ms':>9} {'fetch ms':>9} {'recompute ms':>13} {'speedup':>8} "
        f"{'get_into GB/s':>14} {'bound ms':>9} {'vs bound':>9}",
    ]
    for p in result["points"]:
        if p["prompt_tokens"] != length:
            continue
        rate = p["get_into_bytes_per_s"]
        lines.append(
            f"{p['hit_percent']:>6.0f} {p['hit_tokens']:>8} {p['ttft_reuse_s'] * 1e3:>9.1f} "
            f"{p['lookup_fetch_s'] * 1e3:>9.1f} {p['ttft_recompute_s'] * 1e3:>13.1f} {p['speedup']:>7.1f}x "
            f"{(rate or 0) / 1e9:>14.2f} {p['bound_s'] * 1e3:>9.1f} {p['vs_bound']:>9.2f}"
        )
    return "\n".join(lines)
