"""``kvbench adapter``: pages put and read through each engine adapter, against the raw client moving the same blocks.

    kvbench [--config PATH] adapter [--engines sglang,vllm,lmcache] [--page-size SIZE] [--pages N] [--rounds R]
                                    [--json]

Without ``--config`` a temporary local 12-node cluster is started (real node processes). For each engine whose
adapter can run here (SGLang and LMCache need their packages; vLLM's tier logic, :class:`TierCore`, needs none),
``N`` pages of about ``SIZE`` bytes are, per round, in this order and one after the other:

1. *put* through the adapter (SGLang ``batch_set_v1`` from a page-first host pool, vLLM ``submit_store`` from the
   primary view's rows and the job's report, LMCache ``batched_put`` of memory objects), then the same blocks
   (the same number and sizes: SGLang stores a page's K and V as two) with ``Client.put_from`` under fresh keys;
2. *get* through the adapter (``batch_get_v1`` into other host slots, ``submit_load`` into other rows,
   ``batched_get`` into new memory objects), then ``Client.get_into`` of the raw blocks into preallocated buffers.

Every page read through an adapter is checked byte for byte (outside the timed calls). A first round is untimed.
The report gives each path's median GB/s and ``put_ratio`` / ``get_ratio``: the median over rounds of the adapter's
GB/s over the raw client's, each pair measured back to back (1.0: the adapter costs nothing; the adapter's put
also asks which pages are stored already, a metadata round the raw put does not make).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier.adapters.store import AdapterStore, Keyspace, StoreSettings, pointer_views
from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.cluster.local import NodeStartError
from kvtier.kvstore.units import format_size, parse_size
from kvtier.tools.benchutil import temp_cluster
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import BenchError, UsageError, VerifyError

ENGINES = ("sglang", "vllm", "lmcache")
NEEDS = {"sglang": "sglang.srt.mem_cache.storage", "lmcache": "lmcache.v1.storage_backend.connector"}


def register(commands: Subcommands) -> None:
    p = commands.add("adapter", "pages through each engine adapter, against the raw client moving the same blocks", run)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of sglang,vllm,lmcache")
    p.add_argument("--page-size", default="1MiB", help="bytes per page, about (default 1MiB)")
    p.add_argument("--pages", type=int, default=32, help="pages per call (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise UsageError(f"unknown engines {', '.join(unknown)}: choose among {', '.join(ENGINES)}")
    try:
        page = parse_size(args.page_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if page < 64 << 10 or args.pages <= 0 or args.rounds <= 0:
        raise UsageError("--page-size must be at least 64KiB, --pages and --rounds positive")
    if getattr(args, "config", None):
        result = _bench(_load(args.config), engines, page, args)
    else:
        try:
            with temp_cluster(capacity_bytes=max(1 << 30, 6 * args.pages * page * (args.rounds + 1) // 10)) as local:
                result = _bench(local.config, engines, page, args)
        except NodeStartError as exc:
            raise BenchError(f"the temporary cluster did not start: {exc}") from None
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


def _load(path: str) -> cluster_mod.ClusterConfig:
    try:
        return cluster_map.load_client(path)
    except cluster_mod.ConfigError as exc:
        raise UsageError(str(exc)) from None


def _bench(
    config: cluster_mod.ClusterConfig, engines: list[str], page: int, args: argparse.Namespace
) -> dict[str, Any]:
    if config.path is None:
        raise UsageError("the adapters need the cluster's file")
    out: dict[str, Any] = {
        "command": "adapter",
        "settings": {"page_size": page, "pages": args.pages, "rounds": args.rounds},
        "engines": {},
    }
    for engine in engines:
        if engine in NEEDS and importlib.util.find_spec(NEEDS[engine].split(".")[0]) is None:
            out["engines"][engine] = {"skipped": f"{engine} is not installed (pip install 'kvtier[{engine}]')"}
            continue
        with HARNESSES[engine](config.path, page, args.pages) as harness, Client(config) as raw:
            out["engines"][engine] = _measure(harness, raw, args.rounds)
    return out


class Harness:
    """One adapter, ready to move ``pages`` pages: ``put(r)``/``get(r)`` of round ``r``'s pages (get checks them),
    and ``blocks``: the buffers the adapter moves, for the raw client to move the same."""

    blocks: list[memoryview]
    put: Callable[[int], None]
    get: Callable[[int], None]
    check: Callable[[int], None]  # after each round's get: the pages read equal those stored


def _measure(harness: Harness, raw: Client, rounds: int) -> dict[str, Any]:
    total = sum(len(b) for b in harness.blocks)
    into = [memoryview(bytearray(len(b))) for b in harness.blocks]
    samples: dict[str, list[float]] = {"put": [], "get": [], "raw_put": [], "raw_get": []}
    for r in range(rounds + 1):
        keys = [os.urandom(16) for _ in harness.blocks]
        timed = {
            "put": _timed(harness.put, r),
            "raw_put": _timed(_raw, raw.put_from, keys, harness.blocks),
            "get": _timed(harness.get, r),
            "raw_get": _timed(_raw, raw.get_into, keys, into),
        }
        harness.check(r)
        if r:
            for name, seconds in timed.items():
                samples[name].append(seconds)
    gbps = {name: total / statistics.median(values) / 1e9 for name, values in samples.items()}
    return {
        "bytes_per_call": total,
        "blocks_per_call": len(harness.blocks),
        "put_gbps": gbps["put"],
        "raw_put_gbps": gbps["raw_put"],
        "put_ratio": statistics.median(a / b for a, b in zip(samples["raw_put"], samples["put"], strict=True)),
        "get_gbps": gbps["get"],
        "raw_get_gbps": gbps["raw_get"],
        "get_ratio": statistics.median(a / b for a, b in zip(samples["raw_get"], samples["get"], strict=True)),
    }


def _timed(call: Callable[..., None], *args: Any) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


def _raw(
    call: Callable[[list[bytes], list[memoryview]], list[bool]], keys: list[bytes], blocks: list[memoryview]
) -> None:
    _all(call(keys, blocks), f"raw {call.__name__}")


def _all(results: list[bool], what: str) -> None:
    if not all(results):
        raise BenchError(f"{what}: {results.count(False)} of {len(results)} blocks failed")


# --- one harness per adapter ------------------------------------------------------------------------------------


@contextmanager
def _sglang(path: Any, page: int, pages: int) -> Iterator[Harness]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from kvtier.tools.hostpool import HostPool

    tokens, heads, head_dim = 64, 8, 128
    layers = max(1, page // (2 * tokens * heads * head_dim * 2))
    pool = HostPool(2 * pages * tokens, tokens, layers, heads, head_dim)
    pool.fill(torch.Generator().manual_seed(0))
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.adapters.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "config": str(path),
    }
    config = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, True, "bench", extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    n = pages * tokens
    src, dst = torch.arange(0, n), torch.arange(n, 2 * n)
    slots = pool.kv_buffer.view(torch.uint8)

    def keys(r: int) -> list[str]:
        return [f"bench-{r}-{i}" for i in range(pages)]

    def check(r: int) -> None:
        if not torch.equal(slots[:, :n], slots[:, n:]):
            raise VerifyError("a page read through the SGLang adapter differs from what was stored")
        slots[:, n:].zero_()

    harness = Harness()
    harness.blocks = pointer_views(*pool.get_page_buffer_meta(src))
    harness.put = lambda r: _all(backend.batch_set_v1(keys(r), src), "sglang batch_set_v1")
    harness.get = lambda r: _all(backend.batch_get_v1(keys(r), dst), "sglang batch_get_v1")

    harness.check = check
    try:
        yield harness
    finally:
        backend.close()


@contextmanager
def _vllm(path: Any, page: int, pages: int) -> Iterator[Harness]:
    from kvtier.adapters.vllm import TierCore

    stride = -(-page // 4096) * 4096
    rows = np.random.default_rng(0).integers(-128, 128, (2 * pages, stride), dtype=np.int8)
    core = TierCore(_store(path), Keyspace({"engine": "bench-vllm"}), memoryview(rows))
    jobs = iter(range(1 << 62))

    def job(r: int, load: bool) -> None:
        job_id = next(jobs)
        keys = [f"bench-{r}-{i}".encode() for i in range(pages)]
        core.submit(job_id, keys, np.arange(pages) + (pages if load else 0), load)
        core.drain()
        (done,) = core.finished()
        if done.job_id != job_id or not done.success:
            raise BenchError(f"vllm tier job {job_id} failed")

    harness = Harness()
    harness.blocks = [memoryview(row) for row in rows[:pages]]
    harness.put = lambda r: job(r, False)
    harness.get = lambda r: job(r, True)

    def check(r: int) -> None:
        if not np.array_equal(rows[:pages], rows[pages:]):
            raise VerifyError("a chunk read through the vLLM tier differs from what was stored")
        rows[pages:] = 0

    harness.check = check
    try:
        yield harness
    finally:
        core.shutdown()


@contextmanager
def _lmcache(path: Any, page: int, pages: int) -> Iterator[Harness]:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    chunk, hidden = 64, 1024
    layers = max(1, page // (2 * chunk * hidden * 2))
    prefix = "remote_storage_plugin.kvtier."
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk,
        local_cpu=True,
        max_local_cpu_size=4 * pages * page / 1e9 + 0.1,
        remote_storage_plugins=["kvtier"],
        extra_config={
            prefix + "module_path": "kvtier.adapters.lmcache",
            prefix + "class_name": "KvtierConnectorAdapter",
            prefix + "config": str(path),
        },
    )
    metadata = LMCacheMetadata("bench", 1, 1, 0, 0, torch.bfloat16, (layers, 2, chunk, 8, 128), chunk_size=chunk)
    cpu = LocalCPUBackend(config, metadata)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    connector = CreateConnector("plugin://kvtier", loop, cpu, config, metadata, plugin_name="kvtier")
    objs = [cpu.allocate(metadata.get_shapes(), metadata.get_dtypes(), None) for _ in range(pages)]
    for obj in objs:
        raw = obj.raw_tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    got: list[Any] = []

    def keys(r: int) -> list[Any]:
        return [CacheEngineKey("bench", 1, 0, r * pages + i, torch.bfloat16) for i in range(pages)]

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def put(r: int) -> None:
        for obj in objs:
            obj.ref_count_up()  # LMCache's wrapper drops a reference after a put, as for the engine's own
        call(connector.batched_put(keys(r), objs))

    def get(r: int) -> None:
        got[:] = call(connector.batched_get(keys(r)))
        if any(g is None for g in got):
            raise BenchError("an LMCache chunk was not read back")

    def check(r: int) -> None:
        same = all(bytes(g.byte_array) == bytes(o.byte_array) for g, o in zip(got, objs, strict=True))
        for g in got:
            g.ref_count_down()
        if not same:
            raise VerifyError("a chunk read through the LMCache connector differs from what was stored")

    harness = Harness()
    harness.blocks = [memoryview(o.byte_array).cast("B") for o in objs]
    harness.put, harness.get, harness.check = put, get, check
    try:
        yield harness
    finally:
        call(connector.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _store(path: Any) -> AdapterStore:
    return AdapterStore(StoreSettings.from_mapping({"config": str(path)}, "kvbench adapter"), "kvbench adapter")


HARNESSES = {"sglang": _sglang, "vllm": _vllm, "lmcache": _lmcache}


def _table(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"{s['pages']} pages of about {format_size(s['page_size'])} a call, median of {s['rounds']} rounds"]
    lines.append(f"{'engine':8}  {'put GB/s':>9} {'raw':>6} {'ratio':>6}   {'get GB/s':>9} {'raw':>6} {'ratio':>6}")
    for engine, r in result["engines"].items():
        if "skipped" in r:
            lines.append(f"{engine:8}  skipped: {r['skipped']}")
            continue
        lines.append(
            f"{engine:8}  {r['put_gbps']:9.2f} {r['raw_put_gbps']:6.2f} {r['put_ratio']:6.2f}   "
            f"{r['get_gbps']:9.2f} {r['raw_get_gbps']:6.2f} {r['get_ratio']:6.2f}"
        )
    return "\n".join(lines)
