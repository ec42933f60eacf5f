"""Moving blocks between the store and the paged cache: the one place that knows how.

On a CPU engine a page's memory is handed to the store directly (``get_into`` decodes into it, ``put``
sends from it). On another device the bytes pass through a host buffer; the fetcher process and the
swap-in kernel (``kvtier.transfer``) replace that path without changing this interface.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.engine.paged_cache import PagedKVCache
from kvtier.engine.store import BlockStore


class PageTransfer:
    def __init__(self, store: BlockStore, cache: PagedKVCache) -> None:
        self.store, self.cache = store, cache
        self.on_host = cache.pages.device.type == "cpu"

    def fetch(self, keys: Sequence[bytes], pages: Sequence[int], tokens: Sequence[int]) -> int:
        """Fill ``pages`` with the blocks ``keys`` (chained from ``tokens``); returns how many leading pages
        now hold their block. Pages past that hold unspecified bytes."""
        if self.on_host:
            return self.store.get_into(keys, [_view(self.cache.block(p)) for p in pages], tokens)
        host = [torch.empty(self.cache.page_bytes, dtype=torch.uint8, pin_memory=True) for _ in pages]
        landed = self.store.get_into(keys, [_view(h) for h in host], tokens)
        for page, buf in zip(pages[:landed], host, strict=False):
            self.cache.block(page).copy_(buf, non_blocking=True)
        return landed

    def store_pages(self, keys: Sequence[bytes], pages: Sequence[int], tokens: Sequence[int]) -> int:
        """Put the blocks ``keys`` from ``pages``; returns how many are stored."""
        blocks = [self.cache.block(p) for p in pages]
        if not self.on_host:
            blocks = [b.cpu() for b in blocks]
        return self.store.put(keys, [_view(b) for b in blocks], tokens)


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")
