"""LMCache remote-storage plugin: kvtier as the remote tier behind LMCache's local CPU backend (lmcache 0.5.6).

    remote_storage_plugins: ["kvtier"]
    extra_config:
      remote_storage_plugin.kvtier.module_path: kvtier.adapters.lmcache
      remote_storage_plugin.kvtier.class_name: KvtierConnectorAdapter
      remote_storage_plugin.kvtier.config: /srv/kvtier/cluster.toml

LMCache's ``ConnectorManager`` imports the module, instantiates :class:`KvtierConnectorAdapter` (a
``ConnectorAdapter``), and asks it for the connector of ``plugin://kvtier``. The other settings are read the same
way, ``remote_storage_plugin.<name>.<setting>``: ``token`` or ``token_file``, ``ttl_class``, ``timeout_s``,
``namespace`` (:class:`~kvtier.adapters.store.StoreSettings`) and ``io_threads`` (default 4). A plugin instance
``kvtier.<instance>`` reads its own prefix. ``kvtier://PATH`` (the older ``remote_url``) names the cluster file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.adapters.hosts import host_class
from kvtier.adapters.store import AdapterStore, Keyspace, SettingsError, StoreSettings

log = logging.getLogger("kvtier.adapters.lmcache")

T = TypeVar("T")
ConnectorAdapter = host_class("lmcache", "lmcache.v1.storage_backend.connector", "ConnectorAdapter")
RemoteConnector = host_class("lmcache", "lmcache.v1.storage_backend.connector.base_connector", "RemoteConnector")

PLUGIN_TYPE = "kvtier"
SCHEMA = "kvtier://"
DEFAULT_IO_THREADS = 4


class KvtierConnectorAdapter(ConnectorAdapter):  # type: ignore[misc, valid-type]
    """Answers ``plugin://kvtier`` (and ``plugin://kvtier.<instance>``, ``kvtier://PATH``) with a KvtierConnector."""

    def __init__(self) -> None:
        super().__init__(SCHEMA)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEMA):
            return True
        return url.startswith("plugin://") and url[len("plugin://") :].split(".", 1)[0] == PLUGIN_TYPE

    def create_connector(self, context: Any) -> KvtierConnector:
        path = context.url[len(SCHEMA) :] if context.url.startswith(SCHEMA) else None
        return KvtierConnector(context.loop, context.local_cpu_backend, context.config, context.plugin_name, path)


class KvtierConnector(RemoteConnector):  # type: ignore[misc, valid-type]
    """
    KvtierConnector keeps LMCache's KV chunks in a kvtier cluster, erasure-coded across its nodes.

    A chunk is one kvtier block of the memory object's bytes, received into a memory object that the local CPU
    backend allocates and sent from the one LMCache hands in: no copy either way. Keys are LMCache's key strings
    (model, world size, worker, chunk hash, dtype, tags) within a keyspace of the chunk's shapes, dtypes, format
    and the optional ``namespace``; a chunk shorter than a full one (the last of a request) is read back at its
    length. Chunk metadata is not stored beside the bytes: the keyspace pins it.

    Returns follow ``RemoteConnector``: ``batched_get`` a memory object or None per key (misses release what they
    allocated), ``batched_async_contains`` the number of consecutive keys stored from the first, ``batched_put``
    nothing (LMCache's wrapper drops its reference afterwards). A store that is down or slow is a miss or an unsaved
    chunk, never an exception, and no call waits on it much longer than ``timeout_s``; a call LMCache cancels waits
    for its store call to end before giving its memory objects back. ``list`` is empty: kvtier does not list
    keys. ``use_layerwise`` is not supported.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        plugin_name: str | None = None,
        config_path: str | None = None,
    ) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        name = plugin_name or PLUGIN_TYPE
        where = f"remote_storage_plugin.{name}"
        if config is not None and config.use_layerwise:
            raise SettingsError(f"{where}: kvtier stores whole chunks; use_layerwise is not supported")
        extra = dict(config.extra_config or {}) if config is not None else {}
        values = {k[len(where) + 1 :]: v for k, v in extra.items() if k.startswith(where + ".")}
        if config_path:
            values.setdefault("config", config_path)
        threads = values.get("io_threads", DEFAULT_IO_THREADS)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise SettingsError(f"{where}.io_threads must be a positive integer, got {threads!r}")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.store = AdapterStore(StoreSettings.from_mapping(values, where), f"kvtier LMCache connector {name}")
        metadata = local_cpu_backend.metadata
        self.keyspace = Keyspace(
            {
                "engine": "lmcache",
                "shapes": [list(s) for s in self.meta_shapes],
                "dtypes": [str(d) for d in self.meta_dtypes],
                "format": str(self.meta_fmt),
                "chunk_size": metadata.chunk_size,
                "namespace": self.store.settings.namespace,
            }
        )
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-lmcache")

    def _keys(self, keys: Sequence[Any]) -> tuple[list[bytes], list[bytes]]:
        return self.keyspace.keys([k.to_string() for k in keys])

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the connector's I/O threads. If the awaiting task is cancelled (LMCache's timeouts), the
        store call still runs to its end before the cancellation propagates: the buffers it uses are released
        only after it."""
        running = asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await running
            raise

    # --- presence -------------------------------------------------------------------------------------------

    async def exists(self, key: Any) -> bool:
        return (await self._blocking(self.store.exists, self._keys([key])[0]))[0]

    def exists_sync(self, key: Any) -> bool:
        return self.store.exists(self._keys([key])[0])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return self.store.leading(self._keys(keys)[0])

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return await self._blocking(self.store.leading, self._keys(keys)[0])

    # --- reads --------------------------------------------------------------------------------------------------

    async def get(self, key: Any) -> Any:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        objs = [self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt) for _ in keys]
        found: list[Any] = []
        try:
            found = await self._blocking(self._read, self._keys(keys), objs)
        finally:
            for i, obj in enumerate(objs):
                if obj is not None and not (i < len(found) and found[i] is not None):
                    obj.ref_count_down()
        return found

    def _read(self, mapped: tuple[list[bytes], list[bytes]], objs: list[Any]) -> list[Any]:
        """Full chunks straight into their memory objects; a miss may be a shorter chunk, read whole and copied."""
        keys, headers = mapped
        usable = [i for i, obj in enumerate(objs) if obj is not None]
        views = [memoryview(objs[i].byte_array).cast("B") for i in usable]
        hits = self.store.get_into([keys[i] for i in usable], [headers[i] for i in usable], views)
        result: list[Any] = [None] * len(objs)
        short = []
        for i, view, hit in zip(usable, views, hits, strict=True):
            if hit:
                result[i] = objs[i]
            else:
                short.append((i, view))
        if short:
            blocks = self.store.get([keys[i] for i, _ in short], [headers[i] for i, _ in short])
            for (i, view), block in zip(short, blocks, strict=True):
                if block is not None and 0 < len(block) < len(view) and len(block) % self.single_token_size == 0:
                    view[: len(block)] = block
                    result[i] = self.reshape_partial_chunk(objs[i], len(block))
        return result

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading chunks found; those after the first miss are released."""
        got = await self.batched_get(keys)
        leading = got.index(None) if None in got else len(got)
        for obj in got[leading:]:
            if obj is not None:
                obj.ref_count_down()
        return got[:leading]

    # --- writes -------------------------------------------------------------------------------------------------

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        keys_, headers = self._keys(keys)
        views = [memoryview(obj.byte_array).cast("B") for obj in memory_objs]
        await self._blocking(self.store.put, keys_, headers, views)

    def remove_sync(self, key: Any) -> bool:
        return self.store.delete(self._keys([key])[0])

    async def list(self) -> list[str]:
        return []

    async def close(self) -> None:
        self._io.shutdown(wait=True)
        self.store.close()
