"""The LMCache plugin against real lmcache 0.5.6 (installed by ``make test``) and real local clusters.

LMCache's own ``ConnectorManager`` resolves ``plugin://kvtier`` from the engine config, and its ``RemoteBackend``
(the storage backend LMCache builds for each remote-storage plugin) drives the connector: puts, lookups and reads
of memory objects from LMCache's real local CPU backend.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "lmcache.v1.storage_backend.connector", reason="lmcache 0.5.6 is not installed: `make test` installs it (--no-deps)"
)

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

from kvtier.adapters.lmcache import KvtierConnector  # noqa: E402
from kvtier.adapters.store import SettingsError  # noqa: E402
from kvtier.kvstore.cluster.local import LocalCluster  # noqa: E402

CHUNK = 16
SHAPE = (2, 2, CHUNK, 2, 64)  # layers, K/V, tokens, heads, head size


def engine_config(path: Path, name: str = "kvtier", layerwise: bool = False, **settings: Any) -> LMCacheEngineConfig:
    """The LMCache config of docs/adapters.md."""
    extra = {
        f"remote_storage_plugin.{name}.module_path": "kvtier.adapters.lmcache",
        f"remote_storage_plugin.{name}.class_name": "KvtierConnectorAdapter",
        f"remote_storage_plugin.{name}.config": str(path),
        f"remote_storage_plugin.{name}.timeout_s": 2.0,
    }
    extra.update({f"remote_storage_plugin.{name}.{k}": v for k, v in settings.items()})
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        remote_storage_plugins=[name],
        extra_config=extra,
        use_layerwise=layerwise,
    )


def metadata(model: str = "llama") -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=SHAPE,
        chunk_size=CHUNK,
    )


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """LMCache's event loop: it runs in a thread of its own, as in the engine."""
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    yield running
    running.call_soon_threadsafe(running.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def cluster(make_cluster) -> LocalCluster:
    return make_cluster(capacity_bytes=64 << 20)


class Engine:
    """One LMCache worker's storage side: the local CPU backend and the RemoteBackend of the kvtier plugin."""

    def __init__(self, config: LMCacheEngineConfig, loop: asyncio.AbstractEventLoop, model: str = "llama") -> None:
        self.metadata = metadata(model)
        self.cpu = LocalCPUBackend(config, self.metadata)
        self.remote = RemoteBackend(config, self.metadata, loop, self.cpu, "cpu", plugin_name="kvtier")
        self.loop = loop
        self.allocated: list[Any] = []

    @property
    def connector(self) -> KvtierConnector:
        return self.remote.connection.getWrappedConnector()

    def key(self, chunk: int) -> CacheEngineKey:
        return CacheEngineKey(self.metadata.model_name, 1, 0, chunk, torch.bfloat16)

    def chunk(self, seed: int, tokens: int = CHUNK) -> Any:
        """A memory object of ``tokens`` tokens of random bytes."""
        shapes = [torch.Size([2, 2, tokens, 128])]
        obj = self.cpu.allocate(shapes, [torch.bfloat16], None)
        raw = obj.raw_tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
        self.allocated.append(obj)
        return obj

    def put(self, keys: list[CacheEngineKey], objs: list[Any]) -> None:
        """Submit as LMCache's storage manager does, and wait until LMCache reports every write done."""
        done = threading.Semaphore(0)
        self.remote.batched_submit_put_task(keys, objs, on_complete_callback=lambda _key: done.release())
        for _ in keys:
            assert done.acquire(timeout=30), "LMCache did not report the write done"

    def contains(self, keys: list[CacheEngineKey]) -> int:
        return asyncio.run_coroutine_threadsafe(self.remote.batched_async_contains("lookup", keys), self.loop).result()

    def close(self) -> None:
        for obj in self.allocated:
            obj.ref_count_down()
        self.remote.close()


@pytest.fixture
def engines(loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    made: list[Engine] = []

    def make(config: LMCacheEngineConfig, model: str = "llama") -> Engine:
        made.append(Engine(config, loop, model))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def test_the_connector_manager_resolves_plugin_kvtier_to_the_adapter(cluster: LocalCluster, loop) -> None:
    for name in ("kvtier", "kvtier.primary"):
        config = engine_config(cluster.config_path, name=name)
        md = metadata()
        connector = CreateConnector(f"plugin://{name}", loop, LocalCPUBackend(config, md), config, md, plugin_name=name)
        assert isinstance(connector.getWrappedConnector(), KvtierConnector)
        asyncio.run_coroutine_threadsafe(connector.close(), loop).result()


def test_memory_objects_round_trip_bit_for_bit(cluster: LocalCluster, engines) -> None:
    engine = engines(engine_config(cluster.config_path))
    keys = [engine.key(1000 + i) for i in range(6)]
    objs = [engine.chunk(seed=i) for i in range(6)]
    engine.put(keys[:4], objs[:4])
    assert engine.contains(keys) == 4
    assert engine.contains(keys[4:]) == 0
    got = engine.remote.batched_get_blocking(keys[:4])
    assert [bytes(g.byte_array) for g in got] == [bytes(o.byte_array) for o in objs[:4]]
    assert all(g is not o for g, o in zip(got, objs, strict=False))  # read into fresh memory objects
    engine.allocated += got


def test_a_short_last_chunk_reads_back_at_its_length(cluster: LocalCluster, engines) -> None:
    engine = engines(engine_config(cluster.config_path))
    key = engine.key(2000)
    short = engine.chunk(seed=9, tokens=5)
    engine.put([key], [short])
    (got,) = engine.remote.batched_get_blocking([key])
    engine.allocated.append(got)
    assert got.meta.shape[2] == 5
    assert bytes(got.byte_array) == bytes(short.byte_array)


def test_chunks_of_another_model_or_namespace_are_misses(cluster: LocalCluster, engines) -> None:
    writer = engines(engine_config(cluster.config_path))
    keys = [writer.key(3000 + i) for i in range(3)]
    writer.put(keys, [writer.chunk(seed=20 + i) for i in range(3)])
    assert writer.contains(keys) == 3
    other_namespace = engines(engine_config(cluster.config_path, namespace="fine-tune-b"))
    assert other_namespace.contains(keys) == 0
    other_model = engines(engine_config(cluster.config_path), model="mistral")
    assert other_model.contains([other_model.key(3000 + i) for i in range(3)]) == 0


def test_a_store_that_is_down_is_misses_and_its_objects_are_released(make_cluster, engines) -> None:
    local = make_cluster(capacity_bytes=64 << 20)
    engine = engines(engine_config(local.config_path))
    keys = [engine.key(4000 + i) for i in range(3)]
    engine.put(keys, [engine.chunk(seed=30 + i) for i in range(3)])
    local.stop()
    unsaved = engine.chunk(seed=40)
    handed_out = _recording_allocations(engine)
    assert engine.contains(keys) == 0
    assert engine.remote.batched_get_blocking(keys) == [None, None, None]
    engine.put([engine.key(4100)], [unsaved])  # dropped, without an exception
    assert handed_out and all(obj.get_ref_count() == 0 for obj in handed_out)


def test_a_get_lmcache_cancels_waits_for_the_store_then_releases_its_objects(make_cluster, engines) -> None:
    local = make_cluster(capacity_bytes=64 << 20)
    engine = engines(engine_config(local.config_path))
    keys = [engine.key(5000 + i) for i in range(3)]
    engine.put(keys, [engine.chunk(seed=50 + i) for i in range(3)])
    handed_out = _recording_allocations(engine)
    store = engine.connector.store
    read, ended = store.get_into, threading.Event()

    def get_into(*args: Any) -> list[bool]:
        try:
            return read(*args)
        finally:
            ended.set()

    store.get_into = get_into
    for proc in local.procs.values():
        proc.send_signal(signal.SIGSTOP)
    try:

        async def impatient() -> None:
            await asyncio.wait_for(engine.connector.batched_get(keys), timeout=0.1)

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run_coroutine_threadsafe(impatient(), engine.loop).result(timeout=30)
        assert ended.is_set()  # the read into the memory objects was over before LMCache got them back
    finally:
        for proc in local.procs.values():
            proc.send_signal(signal.SIGCONT)
    assert len(handed_out) == 3 and all(obj.get_ref_count() == 0 for obj in handed_out)


def test_layerwise_and_bad_settings_fail_at_start_with_one_line(cluster: LocalCluster, loop) -> None:
    cases = {
        "use_layerwise": engine_config(cluster.config_path, layerwise=True),
        "io_threads": engine_config(cluster.config_path, io_threads=0),
        "TTL class": engine_config(cluster.config_path, ttl_class="weekly"),
    }
    for what, config in cases.items():
        md = metadata()
        with pytest.raises(SettingsError) as err:
            KvtierConnector(loop, LocalCPUBackend(config, md), config, "kvtier")
        assert what in str(err.value) and "\n" not in str(err.value)


def test_lmcache_starts_without_kvtier_on_a_wrong_cluster_path_saying_so_once_then_every_lookup_is_zero(
    tmp_path: Path,
) -> None:
    """LMCache 0.5.6 catches every error of a remote plugin at start-up: the engine runs on without kvtier."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lmcache.v1.storage_backend.remote_backend")  # LMCache's loggers do not propagate
    logger.addHandler(handler)
    try:
        manager = StorageManager(engine_config(tmp_path / "missing.toml"), metadata(), EventManager())
    finally:
        logger.removeHandler(handler)
    try:
        remote = manager.storage_backends["RemoteBackend-kvtier"]
        assert remote.connection is None
        refused = [line for line in lines if "kvtier LMCache connector kvtier: cluster file" in line]
        assert len(refused) == 1 and "missing.toml does not exist" in refused[0], lines
        key = CacheEngineKey("llama", 1, 0, 1, torch.bfloat16)
        lookup = asyncio.run_coroutine_threadsafe(remote.batched_async_contains("lookup", [key]), manager.loop)
        assert lookup.result(timeout=30) == 0
    finally:
        manager.close()


def _recording_allocations(engine: Engine) -> list[Any]:
    """Every memory object the connector allocates from here on."""
    handed_out: list[Any] = []
    allocate = engine.cpu.allocate

    def recording(*args: Any, **kwargs: Any) -> Any:
        obj = allocate(*args, **kwargs)
        handed_out.append(obj)
        return obj

    engine.cpu.allocate = recording
    return handed_out
