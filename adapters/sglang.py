"""SGLang HiCache storage backend: kvtier as the L3 tier behind SGLang's host memory pool (sglang 0.5.23).

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier", "module_path": "kvtier.adapters.sglang",
            "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "config": "/srv/kvtier/cluster.toml"}'

SGLang's ``StorageBackendFactory`` imports this module, checks that :class:`KvtierHiCacheStorage` is a
``HiCacheStorage``, builds it with the storage config (``extra_config`` is the JSON above) and registers the host
pool. Keys of the extra config read here: ``config`` (required), ``token`` or ``token_file``, ``ttl_class``,
``timeout_s``, ``namespace`` (:class:`~kvtier.adapters.store.StoreSettings`); ``interface_v1`` and ``allocator``
are SGLang's own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier.adapters.hosts import host_class
from kvtier.adapters.store import AdapterStore, Keyspace, StoreSettings, pointer_views

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier.adapters.sglang")

HiCacheStorage = host_class("sglang", "sglang.srt.mem_cache.hicache_storage", "HiCacheStorage")

WHOLE_PAGE = 0xFFFF  # the piece index of a page stored whole by the older get/set calls (a flat tensor)


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc, valid-type]
    """
    KvtierHiCacheStorage stores SGLang's KV cache pages in a kvtier cluster, erasure-coded across its nodes.

    Keys: SGLang's page hashes, taken into a keyspace of the model, KV dtype, host-pool layout, page geometry,
    TP rank and size (not for MLA, whose pages every rank shares), PP and context-parallel ranks and the
    optional ``namespace``: two deployments never read each other's pages, and pages of another geometry are
    misses, never wrong bytes. MLA pages are written only by ``is_storage_writer`` ranks.

    With ``interface_v1`` (the zero-copy path), a page is stored as the buffers that the host pool's
    ``get_page_buffer_meta`` names (K and V of a page-first MHA page, one buffer of an MLA page, one per layer in
    layer-first layouts), each a kvtier block received into or sent from the host pool's own memory. With
    ``"allocator": "shm"`` the host pool is a memfd; pages are addressed the same way, and nothing is copied
    either way (see docs/adapters.md). The older ``get``/``set``/``batch_get``/``batch_set`` calls store a page
    as the one flat tensor SGLang hands them.

    Returns follow ``HiCacheStorage``: ``batch_exists`` the number of consecutive pages stored from the first;
    ``batch_get_v1``/``batch_set_v1`` one boolean per page. A store that is down or slow is a miss or a failed
    write, never an exception, and no call waits on it much longer than ``timeout_s``.
    ``batch_*_v2`` (hybrid models' extra pools) are not supported.
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = storage_config.extra_config or {}
        where = "--hicache-storage-backend-extra-config"
        self.storage_config = storage_config
        self.store = AdapterStore(StoreSettings.from_mapping(extra, where), "kvtier HiCache storage")
        self.zero_copy = bool(extra.get("interface_v1", 0))
        self.is_writer = storage_config.is_storage_writer
        self.pieces = 1
        self.keyspace: Keyspace | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool whose pages this backend reads and writes: the keyspace takes its geometry."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        page = self._page_size()
        if self.zero_copy:
            import torch

            _, sizes = self._buffers(torch.arange(page, dtype=torch.int64), 1)
            self.pieces = len(sizes)
            geometry: Any = sizes
        else:
            geometry = getattr(pool, "size_per_token", None)
        cfg = self.storage_config
        identity = {
            "engine": "sglang",
            "model": cfg.model_name or "",
            "dtype": str(pool.dtype),
            "layout": getattr(pool, "layout", ""),
            "page_size": page,
            "geometry": geometry,
            "interface": "v1" if self.zero_copy else "whole",
            "tp": None if cfg.is_mla_model else [cfg.tp_rank, cfg.tp_size],
            "pp": [cfg.pp_rank, cfg.pp_size],
            "cp": [cfg.attn_cp_rank, cfg.attn_cp_size],
            "dcp": [cfg.dcp_rank, cfg.dcp_size],
            "namespace": self.store.settings.namespace,
        }
        self.keyspace = Keyspace(identity)

    def _page_size(self) -> int:
        cfg = self.storage_config
        return cfg.logical_page_size if cfg.dcp_size > 1 else self.mem_pool_host.page_size

    def _buffers(self, host_indices: torch.Tensor, pages: int) -> tuple[list[int], list[int]]:
        """Pointers and sizes of every buffer of ``pages`` pages, page-major, from the host pool."""
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        pointers, sizes = _flat(pointers), _flat(sizes)
        if len(pointers) != len(sizes) or len(pointers) % pages:
            raise ValueError(f"the host pool named {len(pointers)} buffers for {pages} pages")
        return pointers, sizes

    def _keys(self, page_keys: Sequence[str], pieces: Sequence[int]) -> tuple[list[bytes], list[bytes]] | None:
        if self.keyspace is None:
            log.warning("kvtier HiCache storage used before its host pool was registered: a miss")
            return None
        return self.keyspace.keys(page_keys, pieces)

    # --- the zero-copy interface (interface_v1) -------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        mapped = self._keys(keys, range(self.pieces)) if self.zero_copy else self._whole(keys)
        if mapped is None:
            return 0
        return self.store.leading(mapped[0]) // (self.pieces if self.zero_copy else 1)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self._pages(keys, host_indices, write=False)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not self.is_writer:
            return [True] * len(keys)  # an MLA page is the storage writer rank's to store
        return self._pages(keys, host_indices, write=True)

    def _pages(self, keys: list[str], host_indices: torch.Tensor, write: bool) -> list[bool]:
        """Read or write whole pages straight from/into the host pool's buffers; per page whether all of it moved."""
        if not keys:
            return []
        mapped = self._keys(keys, range(self.pieces))
        try:
            pointers, sizes = self._buffers(host_indices, len(keys))
        except Exception as exc:  # a page the pool cannot name is a miss, not the engine's error
            log.warning("kvtier HiCache storage: the host pool could not name the pages (%s): a miss", exc)
            return [False] * len(keys)
        if mapped is None or len(pointers) != len(keys) * self.pieces:
            return [False] * len(keys)
        views = pointer_views(pointers, sizes)
        call = self.store.put if write else self.store.get_into
        done = call(mapped[0], mapped[1], views)
        return [all(done[i * self.pieces : (i + 1) * self.pieces]) for i in range(len(keys))]

    # --- the older interface: a page is one flat tensor ------------------------------------------------------

    def _whole(self, keys: Sequence[str]) -> tuple[list[bytes], list[bytes]] | None:
        return self._keys(keys, (WHOLE_PAGE,))

    def exists(self, key: str) -> bool:
        mapped = self._whole([key])
        return mapped is not None and self.store.exists(mapped[0])[0]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location], None if target_sizes is None else [target_sizes])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Each page into its target: a tensor (returned filled) or a pointer with ``target_sizes`` bytes."""
        if not keys:
            return []
        mapped = self._whole(keys)
        if mapped is None or target_locations is None:
            return [None] * len(keys)
        views = _targets(target_locations, target_sizes)
        found = self.store.get_into(mapped[0], mapped[1], views)
        return [t if ok else None for t, ok in zip(target_locations, found, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        sizes = None if target_sizes is None else [target_sizes]
        return self.batch_set([key], [value], None if target_location is None else [target_location], sizes)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store each page (a tensor in ``values``, or a pointer with ``target_sizes`` bytes); whether all were."""
        if not keys:
            return False
        if not self.is_writer:
            return True
        mapped = self._whole(keys)
        if mapped is None:
            return False
        sources = values if values is not None and values[0] is not None else target_locations
        if sources is None:
            return False
        kept = [v.contiguous() if hasattr(v, "contiguous") else v for v in sources]  # alive until the put returns
        return all(self.store.put(mapped[0], mapped[1], _targets(kept, target_sizes)))

    def clear(self) -> bool:
        """kvtier does not list a deployment's pages, so it cannot drop them here: its GC expires them by TTL
        (``kvctl evict`` removes them now). Returns False."""
        log.warning("kvtier HiCache storage: clear is not supported; pages expire by TTL (or use kvctl evict)")
        return False

    def close(self) -> None:
        self.store.close()


def _targets(locations: Sequence[Any], sizes: Sequence[int] | None) -> list[memoryview]:
    """Byte views of tensors (contiguous, on the host) or of raw pointers with their sizes."""
    if sizes is not None:
        return pointer_views(list(locations), list(sizes))
    return pointer_views([t.data_ptr() for t in locations], [t.numel() * t.element_size() for t in locations])


def _flat(values: Sequence[Any]) -> list[int]:
    """A page's buffers may come as one list per page (multi-buffer pools): flatten, keeping the order."""
    out: list[int] = []
    for value in values:
        if isinstance(value, list | tuple):
            out.extend(int(v) for v in value)
        else:
            out.append(int(value))
    return out
