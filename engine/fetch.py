"""Moving blocks between the store and the paged cache: the one place that knows how.

Two ways, one interface (:class:`PageTransfer`):

- :class:`StorePages`: the engine's own store client. On a CPU engine a page's memory is handed to the store
  directly (``get_into`` decodes into it, ``put`` sends from it); on another device through a host buffer.
- :class:`FetcherPages`: through the host's ``kvtier-fetcher`` process. Blocks land in its shared-memory
  slots (a host-memory hit costs no store read at all) and are swapped into pages by
  ``kvtier.transfer.swapin`` (an indexed copy on the CPU, the gather kernel on a GPU); new blocks leave the
  same way (swap-out into allocated slots, then the fetcher stores them).

Both answer misses and failures as "fewer blocks": a fetch returns how many *leading* pages hold their block,
a store how many blocks are stored. Nothing here raises because the store or the fetcher is away or broken
(a failed swap is a miss: the engine recomputes). Through the fetcher, a block counts only if its slot still
holds it (generation checked) after the swap-in has finished; one that does not is a miss from there on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kvtier.engine.paged_cache import PagedKVCache
from kvtier.engine.store import BlockStore
from kvtier.kvstore.keys import header_digests
from kvtier.transfer.fetch_client import FetchClient, FetcherError
from kvtier.transfer.swapin import CudaHostMapping, slot_tensor, swap_in, swap_out

log = logging.getLogger("kvtier.engine")


class PageTransfer(Protocol):
    def fetch(self, keys: Sequence[bytes], pages: Sequence[int], tokens: Sequence[int]) -> int:
        """Fill ``pages`` with the blocks ``keys`` (chained from ``tokens``); returns how many leading pages
        now hold their block. Pages past that hold unspecified bytes."""
        ...

    def store_pages(self, keys: Sequence[bytes], pages: Sequence[int], tokens: Sequence[int]) -> int:
        """Put the blocks ``keys`` from ``pages``; returns how many are stored."""
        ...


class StorePages:
    """On a CPU engine a page's memory is handed to the store as is. On a GPU, blocks pass through two pinned
    host buffers (a quarter of the cache each, at most ``staging_bytes``; made with the engine), in turn: a
    fetch is read in at least two groups, and while one group's copies to the device run the store decodes
    the next into the other buffer, so a fetch costs about the store's ``get_into`` alone. Groups are as few
    as the buffers allow: every store call has a fixed cost (on the H200, groups of 128 MiB fetched 2.4 GB at
    3.1 GB/s where one ``get_into`` of it ran at 5.9)."""

    def __init__(self, store: BlockStore, cache: PagedKVCache, staging_bytes: int = 1 << 30) -> None:
        self.store, self.cache = store, cache
        self.on_host = cache.pages.device.type == "cpu"
        pages = cache.pages.shape[0]
        self.group = max(1, min(staging_bytes // cache.page_bytes, -(-pages // 4)))  # blocks a buffer holds
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        if not self.on_host:
            for _ in range(2):
                buf = torch.empty((self.group, cache.page_bytes), dtype=torch.uint8, pin_memory=True)
                event = torch.cuda.Event()
                event.record()
                self._staging.append((buf, event))

    def fetch(self, keys: Sequence[bytes], pages: Sequence[int], tokens: Sequence[int]) -> int:
        if self.on_host:
            return self.store.get_into(keys, [_view(self.cache.block(p)) for p in pages], tokens)
        if not keys:
            return 0
        landed = 0
        size = -(-len(keys) // max(2, -(-len(keys) // self.group)))  # blocks per group: at least two groups
        for i, start in enumerate(range(0, len(keys), size)):
            buf, copied = self._staging[i % 2]
            copied.synchronize()  # this buffer's previous copies to the device are done
            group = keys[start : start + size]
            rows = buf[: len(group)]
            got = self.store.get_into(group, [_view(r) for r in rows], tokens)
            for row, page in zip(rows[:got], pages[start : start + got], strict=True):
                self.cache.block(page).copy_(row, non_blocking=True)
            copied.record()
            landed += got
            if got < len(group):
                break
        torch.cuda.current_stream().synchronize()
        return landed

    def store_pages(self, keys: Sequence[bytes], pages: Sequence[int], tokens: Sequence[int]) -> int:
        if self.on_host:
            return self.store.put(keys, [_view(self.cache.block(p)) for p in pages], tokens)
        stored = 0
        buf = self._staging[0][0]
        for start in range(0, len(keys), self.group):
            group = list(pages[start : start + self.group])
            rows = buf[: len(group)]
            index = torch.tensor(group).to(self.cache.pages.device, non_blocking=True)
            rows.copy_(self.cache.pages.index_select(0, index).view(len(group), -1).view(torch.uint8))
            stored += self.store.put(keys[start : start + len(group)], [_view(r) for r in rows], tokens)
        return stored


class FetcherPages:
    def __init__(self, client: FetchClient, store: BlockStore, cache: PagedKVCache) -> None:
        self.client, self.store, self.cache = client, store, cache
        self._slots: tuple[object, torch.Tensor] | None = None  # (the pool mapping it views, the slots tensor)
        self._cuda: CudaHostMapping | None = None

    def fetch(self, keys: Sequence[bytes], pages: Sequence[int], tokens: Sequence[int]) -> int:
        if not keys:
            return 0
        try:
            with self.client.fetch(keys, self.cache.page_bytes, headers=self._headers(keys, tokens)) as blocks:
                n = blocks.leading(blocks.ok())  # the answers as arrays: no Python object per block
                slots = blocks.slots[:n].astype(np.int32)  # int32 ids: what the GPU kernels read, copied as is
                swap_in(self._slot_rows(), slots, self.cache.pages, np.asarray(pages[:n], dtype=np.int32))
                if self.cache.pages.device.type != "cpu":
                    torch.cuda.current_stream().synchronize()  # before the pins are released
                return blocks.leading(blocks.valid()[:n])  # a slot reused meanwhile is a miss from there
        except (FetcherError, ValueError) as e:  # ValueError: SwapError, or pages no size class holds
            log.warning("fetcher failed, recomputing instead: %s", e)
            return 0

    def store_pages(self, keys: Sequence[bytes], pages: Sequence[int], tokens: Sequence[int]) -> int:
        if not keys:
            return 0
        try:
            slots = self.client.alloc(len(keys), self.cache.page_bytes)
            n = slots.leading(slots.ok())
            ids = slots.slots[:n].astype(np.int32)
            swap_out(self.cache.pages, np.asarray(pages[:n], dtype=np.int32), self._slot_rows(), ids)
            if self.cache.pages.device.type != "cpu":
                torch.cuda.current_stream().synchronize()
            if n < len(slots):
                self.client.release(slots[n:])
            return sum(self.client.put(keys[:n], slots[:n], headers=self._headers(keys[:n], tokens)))
        except (FetcherError, ValueError) as e:
            log.warning("fetcher failed, blocks not stored: %s", e)
            return 0

    def _headers(self, keys: Sequence[bytes], tokens: Sequence[int]) -> list[bytes]:
        """Header digests of ``keys``, any blocks of the chain over ``tokens`` (digests bind each block's parent,
        so they are computed along the whole chain and picked out)."""
        arr = np.asarray(tokens, dtype=np.uint32)
        full = self.store.keys(arr)
        digests = dict(zip(full, header_digests(self.store.namespace, arr, full), strict=True))
        return [digests[k] for k in keys]

    def _slot_rows(self) -> torch.Tensor:
        """The slots of the fetcher's size class for pages as ``uint8 [slots, stride]`` (as the device sees
        them), remapped when the fetcher restarted with a new segment; ValueError if no class holds a page."""
        _, pool = self.client.map_for(self.cache.page_bytes)  # the size class the pages' slots belong to
        if self._slots is None or self._slots[0] is not pool:
            rows = slot_tensor(pool.buffer, stride=pool.stride, slots=pool.slots, offset=pool.data_offset)
            if self.cache.pages.device.type != "cpu":
                if self._cuda is not None:
                    self._cuda.close()
                self._cuda = CudaHostMapping(rows, self.cache.pages.device)
                rows = self._cuda.tensor
            self._slots = (pool, rows)
        return self._slots[1]


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")
