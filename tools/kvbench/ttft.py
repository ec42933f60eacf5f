"""``kvbench ttft``: time to first token against the prefix hit ratio, with and without reuse.

    kvbench [--config PATH] ttft [--checkpoint DIR | --preset tiny] [--prompt-tokens 4000[,L2…]] [--hits 0,50,90,96]
                                 [--repeats 3] [--threads 1] [--device cpu] [--dtype float32] [--chunk-tokens 512]
                                 [--through client|fetcher] [--pool 1GiB] [--node-capacity 2GiB]
                                 [--kv-format exact] [--json] [--json-out FILE]

A real cluster (``--config``, or a temporary local one of 12 node processes of ``--node-capacity`` each) and the
engine in this process. ``--through fetcher`` starts a ``kvtier-fetcher`` (a pool of ``--pool``, its slots the
model's block size) for the run and moves blocks through its shared-memory pool (blocks the prefix run put are then
host-memory hits); ``client`` reads them from the nodes. For every prompt length ``L``, hit ratio ``r`` and repeat:
a fresh random prompt of ``L`` tokens; its first ``h`` tokens (``r·L`` rounded to a multiple of 128, at most
``L − 134``) are prefilled once so the store holds their blocks and the StateBlock at ``h``; then, alternately, TTFT
**without reuse** (``reuse=False``: full prefill) and **with reuse** (exact: ``h`` tokens fetched, ``L − h``
computed). Medians over the repeats. On a GPU every time is taken after the device has finished (the engine
synchronizes).

Beside each point its **bound**: the hit bytes at the store's ``get_into`` rate plus that run's own suffix
compute time. The rate is measured at each point right after its runs: the point's last prefix read whole (page-
sized blocks into touched host buffers), the faster of two reads. Beside it, the **raw** loopback stream of that
host in the same run: the hit bytes over as many Unix-socket streams as the read has lanes (each from its own
sender process into its own receiving thread), what the nodes' sockets alone could carry. Reported: TTFT with and
without reuse, ``speedup`` (the median over repeats of without / with, each pair measured back to back, so that
load from other processes cancels) and ``vs_bound`` (with / bound). Targets: ``vs_bound`` ≤ 1.25; at 96 % on the
CPU, ``speedup`` ≥ 10.

Through the fetcher every repeat has two hits: the prefix is stored through the store client alone (the fetcher's
pool does not hold it), so the first request with reuse is a **cold** store hit (the fetcher reads the blocks into
its pool, promoting them, and swap-in moves them to the device) and the next one, the same prefix with a new suffix
(the cold request stored StateBlocks past the prefix), a **warm** host-pool hit. The warm
hit's bound is its suffix compute plus the hit bytes at the **link** rate: one contiguous copy from pinned host
memory to the device (on a CPU engine, one host memcpy) of up to 1 GiB, measured at each point, the best of three.
Target: warm ``vs_link`` ≤ 1.15.

``--kv-format F`` runs the engine in KV format ``F`` (docs/engine.md): the blocks are stored, read, pooled and swapped
in encoded (decoded by the swap-in on the way), so every byte figure (hit bytes, the ``get_into`` rate, the link
bound) is of encoded blocks; without reuse the engine computes in its dtype as in any format.
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

from kvtier.tools.benchutil import raw_streams_gbps
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import BenchError, UsageError
from kvtier.tools.kvbench.enginebench import add_model_arguments, checkpoint_and_cluster, describe
from kvtier.transfer.fetch_client import FetchClient
from kvtier.transfer.fetcher import LocalFetcher

if TYPE_CHECKING:  # the engine needs torch; kvbench's other commands must run without it
    from kvtier.engine.engine import Engine, Result


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
    p.add_argument(
        "--kv-format",
        default="exact",
        help="the engine's KV format (docs/engine.md): blocks and StateBlocks stored, moved and swapped in encoded",
    )
    p.add_argument("--json-out", type=Path, help="also write the JSON object to this file (after every length)")
    p.add_argument(
        "--check-tokens",
        type=int,
        default=0,
        help="after each point, generate this many greedy tokens of its last prompt with and without reuse and "
        "report whether they are equal (default 0: no check)",
    )


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
        try:
            engine = Engine.from_pretrained(
                checkpoint,
                device=args.device,
                dtype=getattr(torch, args.dtype),
                store=config,
                cache_tokens=2 * max(lengths) + 1024,
                chunk_tokens=args.chunk_tokens,
                kv_format=args.kv_format,
            )
            if args.through == "fetcher":  # its slots sized to this model's blocks
                _hold_states_past_prefixes(engine, lengths, hits)
                shm = f"kvbench-ttft-{secrets.token_hex(4)}"
                slots = f"{engine.block_bytes}B"
                fetcher = LocalFetcher(config, shm, scratch / "fetcher.sock", args.pool, slots).start()
                assert engine.store is not None
                engine.attach_store(engine.store, FetchClient(fetcher.socket_path, engine.store.client.config.token))
            result["settings"] = {
                "checkpoint": describe(args),
                "prompt_tokens": lengths,
                "repeats": args.repeats,
                "threads": args.threads,
                "device": args.device,
                "dtype": args.dtype,
                "chunk_tokens": args.chunk_tokens,
                "block_tokens": engine.block_tokens,
                "block_bytes": engine.block_bytes,
                "kv_format": args.kv_format,
                "through": args.through,
            }
            for length in lengths:
                for point in _bench(engine, length, hits, args.repeats, fetcher is not None, args.check_tokens):
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


def _hold_states_past_prefixes(engine: Engine, lengths: list[int], hits: list[float]) -> None:
    """Through the fetcher a prompt's cold request stores a StateBlock every 128 tokens past its prefix before the
    warm request needs the one at the prefix: give the engine's own StateBlock LRU room for all of them (the 8 B
    checkpoint's 3,072-token suffix at 77,824 tokens stores 24 of 13 MB; the default 256 MiB would drop the one at
    the prefix)."""
    from kvtier.engine.sliding import STATE_INTERVAL
    from kvtier.engine.stateblocks import LocalStateBlocks

    if not isinstance(engine.state_blocks, LocalStateBlocks):
        return
    past = max(((n - hit_tokens(r, n)) // STATE_INTERVAL for n in lengths for r in hits if hit_tokens(r, n)), default=0)
    needed = (past + 2) * engine.state_bytes
    if needed > engine.state_blocks.capacity_bytes:
        engine.state_blocks = LocalStateBlocks(needed, engine.device)


def hit_tokens(ratio: float, length: int) -> int:
    h = round(ratio / 100 * length / 128) * 128
    return min(h, (length - 134) // 128 * 128)


def _bench(
    engine: Engine, length: int, hits: list[float], repeats: int, pooled: bool, check_tokens: int = 0
) -> Iterator[dict[str, Any]]:
    """One point per hit ratio, each as soon as it is measured; ``pooled``: the engine moves blocks through a
    fetcher, and each repeat also measures the cold store hit and the warm pool hit (see the module docstring);
    ``check_tokens``: the point also says whether its last prompt's greedy tokens are the same with reuse."""
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(length)
    engine.generate([rng.integers(0, vocab, length).tolist()], 1, reuse=False)  # warm-up: compute
    warm = rng.integers(0, vocab, 512).tolist()  # warm-up: one hit, so that what a first hit sets up once (the
    _store_prefix(engine, warm[:256], pooled)  # pinned staging buffer, the fetcher's segment and its mapping) is
    _exact(engine, warm, 256)  # not in the first point's times
    for ratio in hits:
        h = hit_tokens(ratio, length)
        runs: dict[str, list[float]] = {"recompute": [], "reuse": [], "cold": [], "compute": [], "fetch": []}
        prefix: list[int] = []
        for _ in range(repeats):
            prompt = rng.integers(0, vocab, length).tolist()
            if h:
                _store_prefix(engine, prompt[:h], pooled)
                prefix = prompt[:h]
            runs["recompute"].append(engine.generate([prompt], 1, reuse=False)[0].ttft_s)
            if pooled:  # the first hit reads the store through the fetcher (and promotes), the second is the pool's
                before = _pool_counts(engine)
                runs["cold"].append(_exact(engine, prompt, h).ttft_s)
                between = _pool_counts(engine)
                # a new suffix: the cold request stored StateBlocks past h, which the same prompt would hit
                prompt = prompt[:h] + rng.integers(0, vocab, length - h).tolist()
            r = _exact(engine, prompt, h)
            if pooled and h:
                _check_hits(h // engine.block_tokens, before, between, _pool_counts(engine))
            runs["reuse"].append(r.ttft_s)
            runs["compute"].append(r.timings["compute_s"])
            runs["fetch"].append(r.timings["lookup_fetch_s"])
        rate = _get_rate(engine, prefix)
        hit_bytes = h // engine.block_tokens * engine.block_bytes
        raw = _raw_rate(engine, hit_bytes)
        reuse_s, compute_s = statistics.median(runs["reuse"]), statistics.median(runs["compute"])
        bound = hit_bytes / rate + compute_s if h else compute_s
        point = {
            "prompt_tokens": length,
            "hit_percent": ratio,
            "hit_tokens": h,
            "ttft_reuse_s": reuse_s,
            "ttft_recompute_s": statistics.median(runs["recompute"]),
            "lookup_fetch_s": statistics.median(runs["fetch"]),
            "compute_s": compute_s,
            "speedup": statistics.median(c / w for c, w in zip(runs["recompute"], runs["reuse"], strict=True)),
            "hit_bytes": hit_bytes,
            "get_into_bytes_per_s": rate if h else None,
            "raw_stream_bytes_per_s": raw if h else None,
            "bound_s": bound,
            "vs_bound": reuse_s / bound,
        }
        if check_tokens:
            point["greedy_equal"] = _greedy_equal(engine, prompt, h, check_tokens)
        if pooled:
            link = _link_rate(engine, hit_bytes)
            link_bound = compute_s + (hit_bytes / link if h else 0.0)
            point |= {
                "ttft_cold_s": statistics.median(runs["cold"]),
                "link_bytes_per_s": link if h else None,
                "link_bound_s": link_bound,
                "vs_link": reuse_s / link_bound,
            }
        yield point


def _greedy_equal(engine: Engine, prompt: list[int], h: int, n: int) -> bool:
    """Whether ``n`` greedy tokens of ``prompt`` are the same computed whole and reusing its stored ``h``."""
    plain = engine.generate([prompt], n, reuse=False)[0]
    reused = engine.generate([prompt], n)[0]
    if reused.hit_tokens < h or reused.replayed:
        raise BenchError(f"expected an exact hit of at least {h} tokens, got {reused.hit_tokens}")
    return plain.tokens == reused.tokens


def _store_prefix(engine: Engine, prefix: list[int], pooled: bool) -> None:
    """Prefill ``prefix`` so the store holds its blocks and the engine its StateBlock; ``pooled``: through the store
    client alone (the fetcher's own fallback), so that the fetcher's pool does not hold them."""
    from kvtier.engine.fetch import FetcherPages

    through = engine.transfer
    if pooled:
        assert isinstance(through, FetcherPages)
        engine.transfer = through.fallback
    try:
        engine.generate([prefix], 1)
    finally:
        engine.transfer = through


def _pool_counts(engine: Engine) -> tuple[int, int]:
    """(blocks the fetcher's pool answered, blocks it read from the store) for this engine's tenant so far."""
    stats = engine.transfer.client.stats()  # type: ignore[union-attr]
    return stats["blocks_hit"], stats["blocks_fetched"]


def _check_hits(blocks: int, before: tuple[int, int], between: tuple[int, int], after: tuple[int, int]) -> None:
    """BenchError unless the cold request read its ``blocks`` from the store and the warm one found them pooled."""
    fetched, hit = between[1] - before[1], after[0] - between[0]
    if fetched < blocks or hit < blocks or after[1] != between[1]:
        raise BenchError(
            f"expected the cold hit to read {blocks} blocks from the store and the warm one to find them in the pool;"
            f" read {fetched} cold, pooled {hit} and read {after[1] - between[1]} warm"
        )


def _exact(engine: Engine, prompt: list[int], h: int) -> Result:
    r = engine.generate([prompt], 1)[0]
    if r.hit_tokens != h or r.replayed:
        raise BenchError(f"expected an exact hit of {h} tokens, got {r.hit_tokens} (replayed={r.replayed})")
    return r


def _link_rate(engine: Engine, hit_bytes: int) -> float:
    """Bytes per second of one contiguous copy of ``min(hit_bytes, 1 GiB)`` from pinned host memory to the engine's
    device (a CPU engine: one host memcpy), the best of three; inf for nothing to copy."""
    import torch

    n = min(hit_bytes, 1 << 30)
    if not n:
        return float("inf")
    device = engine.cache.pages.device
    on_gpu = device.type == "cuda"
    src = torch.ones(n, dtype=torch.uint8, pin_memory=on_gpu)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        if on_gpu:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return n / best


def _get_rate(engine: Engine, prefix: list[int]) -> float:
    """The store's ``get_into`` rate for ``prefix``'s blocks read whole into touched host buffers (the faster of
    two reads); inf for an empty prefix."""
    store = engine.store
    assert store is not None
    keys = store.keys(prefix)
    if not keys:
        return float("inf")
    buffers = np.ones((len(keys), engine.block_bytes), dtype=np.uint8)
    views = [memoryview(row) for row in buffers]
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        got = store.get_into(keys, views, prefix)
        best = min(best, time.perf_counter() - start)
        if got != len(keys):
            raise BenchError(f"get_into found {got} of {len(keys)} blocks just stored")
    return len(keys) * engine.block_bytes / best


def _raw_rate(engine: Engine, hit_bytes: int) -> float:
    """Bytes per second of ``hit_bytes`` over raw loopback Unix streams, one per lane of a read of that size; inf for
    nothing to read."""
    if not hit_bytes:
        return float("inf")
    store = engine.store
    assert store is not None
    return raw_streams_gbps(hit_bytes, store.client.lane_count(hit_bytes), unix=True) * 1e9


def _text(result: dict[str, Any], length: int) -> str:
    s = result["settings"]
    lines = [
        f"TTFT, {s['checkpoint']}, L = {length} tokens, {s['device']} {s['dtype']}, {s['threads']} thread(s), "
        f"chunks of {s['chunk_tokens']}, blocks of {s['block_tokens']} tokens / {s['block_bytes']} B "
        f"({s.get('kv_format', 'exact')}) via the "
        f"{s['through']}; medians of {s['repeats']}",
        f"{'hit %':>6} {'hit tok':>8} {'reuse ms':>9} {'fetch ms':>9} {'recompute ms':>13} {'speedup':>8} "
        f"{'get_into GB/s':>14} {'raw GB/s':>9} {'bound ms':>9} {'vs bound':>9}",
    ]
    pooled = s["through"] == "fetcher"
    if pooled:
        lines[0] += "; reuse = a warm pool hit, cold = a store hit through the fetcher"
        lines[1] += f" {'cold ms':>8} {'link GB/s':>10} {'link bound':>11} {'vs link':>8}"
    for p in result["points"]:
        if p["prompt_tokens"] != length:
            continue
        rate = p["get_into_bytes_per_s"]
        line = (
            f"{p['hit_percent']:>6.0f} {p['hit_tokens']:>8} {p['ttft_reuse_s'] * 1e3:>9.1f} "
            f"{p['lookup_fetch_s'] * 1e3:>9.1f} {p['ttft_recompute_s'] * 1e3:>13.1f} {p['speedup']:>7.1f}x "
            f"{(rate or 0) / 1e9:>14.2f} {(p['raw_stream_bytes_per_s'] or 0) / 1e9:>9.2f} "
            f"{p['bound_s'] * 1e3:>9.1f} {p['vs_bound']:>9.2f}"
        )
        if "greedy_equal" in p:
            line += f" greedy {'=' if p['greedy_equal'] else '≠'}"
        if pooled:
            line += (
                f" {p['ttft_cold_s'] * 1e3:>8.1f} {(p['link_bytes_per_s'] or 0) / 1e9:>10.2f} "
                f"{p['link_bound_s'] * 1e3:>11.1f} {p['vs_link']:>8.2f}"
            )
        lines.append(line)
    return "\n".join(lines)
