"""``kvbench fetch``: reading blocks through the fetcher into the host pool, against ``get_into`` private buffers.

    kvbench [--config PATH] fetch [--block-size SIZE] [--blocks N] [--rounds R] [--workers W] [--json]

Without ``--config`` a temporary local 12-node cluster is started (real node processes). Two sets of ``N`` blocks
are stored; a ``kvtier-fetcher`` process is started with a pool of exactly ``N`` slots for the benchmark's tenant
(the cluster token's; each tenant of the cluster file has an equal share), so fetching the sets in turn misses the
pool every time (each fetch evicts the other set): every timed fetch reads the store. Per round,
in the same process and one after the other:

1. *baseline*: ``Client.get_into`` of one set into preallocated private buffers (what an engine without the fetcher
   does);
2. *fetch*: ``FetchClient.fetch`` of the other set (the fetcher reads it straight into slots; the engine gets
   views), then ``release``;
3. *hit*: the same fetch again: every block is a host-memory hit, no node is asked;
4. *hit1*: a fetch of one of those blocks: what a request costs end to end with no store work (its fixed cost).

A first round is untimed (it touches the pool's fresh memory). Bytes read are checked on that round. The report
gives medians over rounds, and ``fetch_vs_get_into``: the median over rounds of fetch GB/s / baseline GB/s, each
pair measured back to back (target ≥ 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import NodeStartError
from kvtier.kvstore.units import format_size, parse_size
from kvtier.tools.benchutil import temp_cluster
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import BenchError, UsageError, VerifyError, cluster_config
from kvtier.transfer.fetch_client import FetchClient
from kvtier.transfer.fetch_protocol import BlockStatus
from kvtier.transfer.fetcher import LocalFetcher


def register(commands: Subcommands) -> None:
    p = commands.add("fetch", "fetch into the host pool through the fetcher, against get_into private buffers", run)
    p.add_argument("--block-size", default="1MiB", help="block size (default 1MiB)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per fetch (default 64)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--workers", type=int, default=2, help="fetcher worker threads (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        block = parse_size(args.block_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if block <= 0 or args.blocks <= 0 or args.rounds <= 0:
        raise UsageError("--block-size, --blocks and --rounds must be positive")
    if getattr(args, "config", None):
        result = _bench(cluster_config(args), block, args)
    else:
        try:
            with temp_cluster(capacity_bytes=max(1 << 30, 8 * args.blocks * block // 10)) as local:
                result = _bench(local.config, block, args)
        except NodeStartError as exc:
            raise BenchError(f"the temporary cluster did not start: {exc}") from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0


def _bench(config: cluster_mod.ClusterConfig, block: int, args: argparse.Namespace) -> dict[str, Any]:
    n = args.blocks
    rng = np.random.default_rng(1)
    sets = [[secrets.token_bytes(16) for _ in range(n)] for _ in range(2)]
    data = [rng.integers(0, 256, (n, block), dtype=np.uint8) for _ in range(2)]
    private = np.zeros((n, block), dtype=np.uint8)
    with Client(config) as client:
        for keys, blocks in zip(sets, data, strict=True):
            if not all(client.put(keys, list(blocks))):
                raise BenchError("the cluster did not store every block")
        with tempfile.TemporaryDirectory(prefix="kvbench-fetch-") as tmp:
            fetcher = _start_fetcher(config, tmp, n, block, args)
            fc = FetchClient(fetcher.socket_path, config.token)
            try:
                samples: dict[str, list[float]] = {"get_into": [], "fetch": [], "hit": [], "hit1": []}
                for r in range(args.rounds + 1):
                    for s in (0, 1):
                        timed = _round(client, fc, sets, data, private, s, verify=r == 0)
                        if r > 0:
                            for name, seconds in timed.items():
                                samples[name].append(seconds)
                stats = fc.stats()
            finally:
                fc.close()
                fetcher.stop()
    gbps = {name: n * block / statistics.median(values) / 1e9 for name, values in samples.items()}
    return {
        "command": "fetch",
        "settings": {"block_size": block, "blocks": n, "rounds": args.rounds, "workers": args.workers},
        "get_into_gbps": gbps["get_into"],
        "fetch_gbps": gbps["fetch"],
        "hit_gbps": gbps["hit"],
        "hit_ms": statistics.median(samples["hit"]) * 1e3,
        "hit1_ms": statistics.median(samples["hit1"]) * 1e3,
        "fetch_vs_get_into": statistics.median(
            b / f for b, f in zip(samples["get_into"], samples["fetch"], strict=True)
        ),
        "pool": {k: stats[k] for k in ("slots", "hits", "misses", "hit_ratio", "evictions")},
    }


def _start_fetcher(
    config: cluster_mod.ClusterConfig, tmp: str, n: int, block: int, args: argparse.Namespace
) -> LocalFetcher:
    if config.path is None:
        raise UsageError("the cluster needs a cluster file for the fetcher")
    shm = f"kvbench-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        sock = Path(tmp) / "fetcher.sock"
        token_file = getattr(args, "token_file", None)  # the token kvbench itself was given, for a client file
        extra = ["--token-file", str(token_file)] if token_file else []
        size = n * block * len(config.tenants)  # N slots for this tenant's share
        return LocalFetcher(config.path, shm, sock, f"{size}B", f"{block}B", args.workers, extra).start()
    except RuntimeError as exc:
        raise BenchError(str(exc)) from None


def _round(
    client: Client,
    fc: FetchClient,
    sets: list[list[bytes]],
    data: list[np.ndarray],
    private: np.ndarray,
    s: int,
    verify: bool,
) -> dict[str, float]:
    """Baseline read of set ``s``; fetch (a pool miss), fetch again (a hit) of the other set, and one block of it."""
    other = 1 - s
    block = private.shape[1]
    start = time.perf_counter()
    found = client.get_into(sets[s], list(private))
    baseline = time.perf_counter() - start
    if not all(found) or (verify and not np.array_equal(private, data[s])):
        raise VerifyError("get_into did not read back what was stored")
    fetched = _timed_fetch(fc, sets[other], block, data[other] if verify else None, BlockStatus.FETCHED)
    hit = _timed_fetch(fc, sets[other], block, None, BlockStatus.HIT)
    hit1 = _timed_fetch(fc, sets[other][:1], block, None, BlockStatus.HIT)
    return {"get_into": baseline, "fetch": fetched, "hit": hit, "hit1": hit1}


def _timed_fetch(
    fc: FetchClient, keys: list[bytes], block: int, expected: np.ndarray | None, status: BlockStatus
) -> float:
    """Seconds one fetch of ``keys`` took; every block must come back ``status`` (and equal ``expected``)."""
    start = time.perf_counter()
    got = fc.fetch(keys, block)
    seconds = time.perf_counter() - start
    fc.release(got)
    if (got.status != status).any():  # the answers' columns: no Block object made, as the engine uses them
        raise BenchError(f"expected every block {status.name}, got {sorted({b.status.name for b in got})}")
    if expected is not None and not all(np.array_equal(b.array(), x) for b, x in zip(got, expected, strict=True)):
        raise VerifyError("a fetched block differs from what was stored")
    return seconds


def _print(result: dict[str, Any]) -> None:
    s = result["settings"]
    print(f"{s['blocks']} blocks of {format_size(s['block_size'])} per call, median of {s['rounds']} rounds")
    print(f"get_into private buffers  {result['get_into_gbps']:6.2f} GB/s   (baseline)")
    print(f"fetch into the host pool  {result['fetch_gbps']:6.2f} GB/s   {result['fetch_vs_get_into']:.2f}× baseline")
    print(f"fetch, host-memory hits   {result['hit_gbps']:6.2f} GB/s   {result['hit_ms']:.2f} ms a call, no node asked")
    print(f"fetch of one pooled block  {result['hit1_ms']:.3f} ms a call (the fixed cost of a request)")
