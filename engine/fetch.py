"""Moving blocks between the store and the paged cache: the one place that knows how.

Two ways, one interface (:class:`PageTransfer`):

- :class:`StorePages`: the engine's own store client. On a CPU engine a page's memory is handed to the store
  directly (``get_into`` decodes into it, ``put`` sends from it); on another device through a host buffer.
- :class:`FetcherPages`: through the host's ``kvtier-fetcher`` process. Blocks land in its shared-memory
  slots (a host-memory hit costs no store read at all) and are swapped into pages by
  ``kvtier.transfer.swapin`` (an indexed copy on the CPU, the gather kernel on a GPU); new blocks leave the
  same way (swap-out into the tenant's outbox slots, then the fetcher stores them).

With a low-precision KV format (``formats.Layout``, not the identity) blocks are encoded on the way out, on the
pages' device (a GPU encodes before the bytes cross PCIe), and decoded on the way in: by the swap-in's decoding
kernel (fetcher slots, or the pinned staging rows, read across PCIe by the GPU), or in torch on a CPU engine. Only
the encoded bytes are stored, cached and moved; the store and the fetcher never learn what they hold.

Both answer misses and failures as "fewer blocks": a fetch returns how many *leading* pages hold their block,
a store how many blocks are stored. Nothing here raises because the store or the fetcher is away or broken.
Through the fetcher, a block counts only if its slot still holds it (generation checked) after the swap-in has
finished; one that does not is a miss from there on. While the fetcher is away (not started yet, restarting,
dead), and for blocks it cannot stage (its pool full, or never able to take blocks this large), blocks go through
the engine's own store client instead: reuse is kept, at the store's speed. The fetcher being away is logged once
when it goes and once when it is back, a block it can never take once per reason (with the fix), all counted.
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kvtier.engine.formats import Layout
from kvtier.engine.paged_cache import PagedKVCache
from kvtier.engine.store import BlockStore
from kvtier.kvstore.client.read_watch import ReadWatch
from kvtier.kvstore.keys import TokenInput
from kvtier.kvstore.wire.transport import AuthError
from kvtier.transfer.availability import Availability
from kvtier.transfer.fetch_client import Blocks, FetchClient, FetcherError
from kvtier.transfer.fetch_protocol import BlockStatus
from kvtier.transfer.staging import Region
from kvtier.transfer.swapin import CudaHostMapping, SwapError, slot_tensor, swap_in, swap_out

log = logging.getLogger("kvtier.engine")
UNAVAILABLE = (FetcherError, AuthError)  # the fetcher is away, or refuses this engine's token


class PageTransfer(Protocol):
    def fetch(self, keys: Sequence[bytes], pages: Sequence[int], tokens: TokenInput) -> int:
        """Fill ``pages`` with the blocks ``keys`` (chained from ``tokens``); returns how many leading pages
        now hold their block. Pages past that hold unspecified bytes."""
        ...

    def store_pages(self, keys: Sequence[bytes], pages: Sequence[int], tokens: TokenInput) -> int:
        """Put the blocks ``keys`` from ``pages``; returns how many are stored."""
        ...


class StorePages:
    """On a CPU engine a page's memory is handed to the store as is. On a GPU, blocks pass through one pinned host
    buffer (half the cache, at most ``staging_bytes``; made at the first use): a fetch is one store read of as many
    blocks as the buffer holds (the whole prefix, for any prompt up to half the cache), and blocks are copied to
    the device while the read runs: every ``SETTLED_POLL_S`` this thread asks the read which leading blocks of each
    lane have settled (``client.read_watch``: whole and checksummed, while the receiving threads stay in compiled
    code) and copies those, and the rest of a lane when the lane ends. So a fetch costs about the store's
    ``get_into`` plus the copy of what landed in its last few milliseconds. (Before: each lane copied when it ended;
    the 8 lanes of a 2.45 GB prefix end within ~20 ms of each other and each takes 5.6 ms to copy, so the fetch
    ended 16-27 ms after the read on the H200.)"""

    SETTLED_POLL_S = 0.010  # ~150 MB a poll at 15 GB/s: ~3 ms of copy left after the read's last byte (4 ms
    # polls were no faster on the H200: each takes the interpreter from the lanes for ~0.5 ms)

    def __init__(
        self, store: BlockStore, cache: PagedKVCache, form: Layout | None = None, staging_bytes: int = 4 << 30
    ) -> None:
        self.store, self.cache = store, cache
        self.form = form if form is not None and not form.identity else None  # None: blocks are pages' bytes
        self.block_bytes = cache.page_bytes if self.form is None else self.form.encoded_bytes
        self.on_host = cache.pages.device.type == "cpu"
        pages = cache.pages.shape[0]
        self.rows = max(1, min(staging_bytes // self.block_bytes, -(-pages // 2)))  # blocks the buffer holds
        self._buffer: torch.Tensor | None = None
        self._views: list[memoryview] = []  # its rows as the store reads into them (made once: 5 ms at 1,168)
        self._on_device: torch.Tensor | None = None  # the buffer as the GPU reads it (decoding, see _decode)
        self._mapping: CudaHostMapping | None = None

    @property
    def _staging(self) -> torch.Tensor:
        """The pinned buffer, made at the first use (an engine whose blocks go through the fetcher may never need
        it)."""
        if self._buffer is None:
            shape = (self.rows, self.block_bytes)
            if self.form is not None and not self.on_host:  # registered and mapped: the decoding swap-in reads it
                memory = mmap.mmap(-1, self.rows * self.block_bytes)
                host = torch.frombuffer(memory, dtype=torch.uint8).view(shape)
                self._mapping = CudaHostMapping(host.view(-1), self.cache.pages.device)
                self._buffer, self._on_device = host, self._mapping.tensor.view(shape)
            else:
                self._buffer = torch.empty(shape, dtype=torch.uint8, pin_memory=not self.on_host)
            self._views = [_view(r) for r in self._buffer]
        return self._buffer

    def fetch(self, keys: Sequence[bytes], pages: Sequence[int], tokens: TokenInput) -> int:
        if self.on_host and self.form is None:
            return self.store.get_into(keys, [_view(self.cache.block(p)) for p in pages], tokens)
        landed = 0
        for start in range(0, len(keys), self.rows):
            group = keys[start : start + self.rows]
            got = self._fetch_group(group, pages[start : start + len(group)], tokens)
            landed += got
            if got < len(group):
                break
        return landed

    def _fetch_group(self, keys: Sequence[bytes], pages: Sequence[int], tokens: TokenInput) -> int:
        """One store read into the buffer on a thread of its own, this thread copying blocks to the device as they
        settle and each lane's rest as it ends; returns when the copies are done (the buffer is free again)."""
        rows = self._staging[: len(keys)]
        views = self._views[: len(keys)]
        ended: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        watch = ReadWatch()
        got: list[int] = []
        copied: dict[int, int] = {}  # a lane's first block -> the end of what is copied of it

        def read() -> None:
            try:
                got.append(
                    self.store.get_into(keys, views, tokens, on_landed=lambda lo, hi: ended.put((lo, hi)), watch=watch)
                )
            finally:
                ended.put(None)

        def copy(lo: int, hi: int) -> None:  # a miss's page gets bytes too: pages past what landed are recomputed
            start = copied.get(lo, lo)
            if hi <= start:
                return
            copied[lo] = hi
            if self.form is not None:  # decoded on the way: the GPU reads the encoded rows across PCIe
                self._decode(rows, start, hi, pages[start:hi])
                return
            for at, first, n in _runs(pages[start:hi]):  # one copy per run of consecutive pages
                self.cache.block_run(first, n).copy_(rows[start + at : start + at + n], non_blocking=True)

        reader = threading.Thread(target=read, name="kvtier-fetch")
        reader.start()
        try:
            while True:
                try:
                    span = ended.get(timeout=self.SETTLED_POLL_S)
                except queue.Empty:
                    for lo, hi in watch.settled():
                        copy(lo, hi)
                    continue
                if span is None:
                    break
                copy(*span)
        finally:
            reader.join()
            if not self.on_host:
                torch.cuda.current_stream().synchronize()
        return got[0] if got else 0

    def _decode(self, rows: torch.Tensor, lo: int, hi: int, pages: Sequence[int]) -> None:
        """Encoded rows ``lo … hi-1`` of the buffer decoded into ``pages``: on a GPU one launch of the decoding
        swap-in, which reads the rows where they are (the buffer is registered with CUDA and mapped); on the CPU in
        torch."""
        assert self.form is not None
        if self.on_host:
            pages_bytes = self.cache.pages.view(self.cache.num_pages, -1).view(torch.uint8)
            pages_bytes.index_copy_(0, torch.tensor(list(pages), dtype=torch.long), self.form.decode(rows[lo:hi]))
            return
        assert self._on_device is not None
        staged = np.arange(lo, hi, dtype=np.int32)
        swap_in(self._on_device, staged, self.cache.pages, np.asarray(pages, np.int32), decode=self.form.decoder)

    def store_pages(self, keys: Sequence[bytes], pages: Sequence[int], tokens: TokenInput) -> int:
        if self.on_host and self.form is None:
            return self.store.put(keys, [_view(self.cache.block(p)) for p in pages], tokens)
        stored = 0
        buf = self._staging
        for start in range(0, len(keys), self.rows):
            group = list(pages[start : start + self.rows])
            rows = buf[: len(group)]
            rows.copy_(_gather(self.cache, group, self.form))
            stored += self.store.put(keys[start : start + len(group)], self._views[: len(group)], tokens)
        return stored


class FetcherPages:
    """Blocks through the host's fetcher (see the module docstring); through ``fallback``, the engine's own store
    client, while the fetcher is away and for blocks it cannot stage."""

    def __init__(self, client: FetchClient, store: BlockStore, cache: PagedKVCache, form: Layout | None = None) -> None:
        self.client, self.store, self.cache = client, store, cache
        self.fallback = StorePages(store, cache, form)
        self.form, self.block_bytes = self.fallback.form, self.fallback.block_bytes
        self.availability = Availability(
            f"the fetcher at {client.socket_path}", "blocks go through the store client", log
        )
        self.unstaged = 0  # blocks the fetcher could not stage, read or stored through the store client instead
        self._refusals: set[str] = set()  # reasons logged (once each)
        self._rows: dict[int, tuple[Region, torch.Tensor, CudaHostMapping | None]] = {}  # by page bytes and kind
        try:
            client.connect()
        except UNAVAILABLE as e:  # the engine starts anyway, and uses the fetcher once it is there
            self.availability.failed(e)

    def fetch(self, keys: Sequence[bytes], pages: Sequence[int], tokens: TokenInput) -> int:
        if not keys:
            return 0
        try:
            blocks = self.client.fetch(keys, self.block_bytes, headers=self.store.headers(keys, tokens))
            try:
                n = blocks.leading(blocks.ok())  # the answers as arrays: no Python object per block
                if n:
                    assert blocks.segment is not None
                    slots = blocks.slots[:n].astype(np.int32)  # int32 ids: what the GPU kernels read, copied as is
                    decode = None if self.form is None else self.form.decoder
                    rows = self._slot_rows(blocks.segment)
                    swap_in(rows, slots, self.cache.pages, np.asarray(pages[:n], np.int32), decode=decode)
                    if self.cache.pages.device.type != "cpu":
                        torch.cuda.current_stream().synchronize()  # before the pins are released
                landed = blocks.leading(blocks.valid()[:n])  # a slot reused meanwhile is a miss from there
                unstaged = self._unstaged(blocks, n) if landed == n else False
            finally:  # the pins, dropped without waiting for the fetcher's answer
                self.client.release_later(blocks)
        except UNAVAILABLE as e:
            self.availability.failed(e)
            return self._through_the_store(keys, pages, tokens)
        except (SwapError, RuntimeError) as e:  # the slots cannot reach the pages here (CUDA refused to map them)
            self._refused(f"{type(e).__name__}: {e}")
            return self._through_the_store(keys, pages, tokens)
        self.availability.answered()
        if unstaged:  # the rest through the store client: a block the pool cannot take is no lost reuse
            return n + self._through_the_store(keys[n:], pages[n:], tokens)
        return landed

    def _through_the_store(self, keys: Sequence[bytes], pages: Sequence[int], tokens: TokenInput) -> int:
        """Read ``keys`` through the store client instead (counted in ``fetcher_unstaged_blocks``)."""
        got = self.fallback.fetch(keys, pages, tokens)
        self.unstaged += got
        return got

    def store_pages(self, keys: Sequence[bytes], pages: Sequence[int], tokens: TokenInput) -> int:
        """Swap pages out into outbox slots and have the fetcher store them, as many at a time as the outbox gives
        (it copies them into its cache, so the next request for them is a host hit); what it cannot take goes
        through the store client."""
        if not keys:
            return 0
        stored = done = 0
        try:
            while done < len(keys):
                slots = self.client.alloc(len(keys) - done, self.block_bytes)
                n = slots.leading(slots.ok())
                if n == 0:
                    self._unstaged(slots, 0)
                    break
                assert slots.segment is not None
                ids = slots.slots[:n].astype(np.int32)
                at = slice(done, done + n)
                if self.form is None:
                    swap_out(self.cache.pages, np.asarray(pages[at], np.int32), self._slot_rows(slots.segment), ids)
                else:  # encoded on the device first: only the encoded bytes cross PCIe
                    encoded = _gather(self.cache, pages[at], self.form)
                    swap_out(encoded, np.arange(n, dtype=np.int32), self._slot_rows(slots.segment), ids)
                if self.cache.pages.device.type != "cpu":
                    torch.cuda.current_stream().synchronize()
                stored += sum(self.client.put(keys[at], slots[:n], headers=self.store.headers(keys[at], tokens)))
                done += n
        except UNAVAILABLE as e:
            self.availability.failed(e)
        else:
            self.availability.answered()
        if done < len(keys):
            rest = self.fallback.store_pages(keys[done:], pages[done : len(keys)], tokens)
            self.unstaged += rest
            stored += rest
        return stored

    def stats(self) -> dict[str, int]:
        return {**self.availability.stats("fetcher"), "fetcher_unstaged_blocks": self.unstaged}

    def _unstaged(self, blocks: Blocks, n: int) -> bool:
        """Whether block ``n`` of ``blocks`` (the first not in a slot) is one the fetcher could not place (FULL or
        ERROR, not a miss); a reason it gives is logged once (it says what to change)."""
        if n >= len(blocks) or int(blocks.status[n]) not in (BlockStatus.FULL, BlockStatus.ERROR):
            return False
        why = blocks.errors.get(n, "")
        if why:
            self._refused(why)
        return True

    def _refused(self, why: str) -> None:
        """Blocks cannot be staged for ``why``: said once (per reason), loudly."""
        if why not in self._refusals:
            self._refusals.add(why)
            log.error("the fetcher cannot stage these blocks, they go through the store client: %s", why)

    def _slot_rows(self, segment: Region) -> torch.Tensor:
        """``segment``'s slots as ``uint8 [slots, stride]`` as the device sees them: a CPU view, or on a GPU the
        segment registered with CUDA (read-only for a cache segment) when first seen. One registration is kept per
        kind of segment (cache, outbox): a new segment of that kind (the fetcher restarted, or made a new one)
        replaces the last."""
        kind = int(segment.writable)
        held = self._rows.get(kind)
        if held is not None and held[0] is segment:
            return held[1]
        rows = slot_tensor(segment.buffer, stride=segment.stride, slots=segment.slots, offset=segment.data_offset)
        mapping = None
        if self.cache.pages.device.type != "cpu":
            if held is not None and held[2] is not None:
                held[2].close()
            mapping = CudaHostMapping(rows, self.cache.pages.device, read_only=not segment.writable)
            rows = mapping.tensor
        self._rows[kind] = (segment, rows, mapping)
        return rows


def _gather(cache: PagedKVCache, pages: Sequence[int], form: Layout | None) -> torch.Tensor:
    """``pages`` as one uint8 tensor [n, block bytes] on the cache's device: their bytes, or encoded by ``form``."""
    index = torch.tensor(list(pages)).to(cache.pages.device, non_blocking=True)
    rows = cache.pages.index_select(0, index).view(len(pages), -1).view(torch.uint8)
    return rows if form is None else form.encode(rows)


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``pages`` as runs of consecutive page numbers: (position in ``pages``, first page, length) each."""
    p = np.asarray(pages, dtype=np.int64)
    if not len(p):
        return []
    starts = np.flatnonzero(np.diff(p, prepend=p[0] - 2) != 1)
    ends = [*starts[1:].tolist(), len(p)]
    return [(a, int(p[a]), b - a) for a, b in zip(starts.tolist(), ends, strict=True)]
