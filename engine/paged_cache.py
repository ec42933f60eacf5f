"""Pages: one page = one store block. :class:`PagePool` hands pages out; what a page holds is the model family's
(``family.py``). The dense families' cache, :class:`PagedKVCache`, keeps the global layers' K and V:

A page holds ``block_tokens`` positions of every global layer's keys and values, laid out contiguously as

    [global layer g][K=0 | V=1][token t][kv head h][head dim d]      (row-major, ``kv_dtype``)

so a page's bytes *are* a stored block: ``get_into`` lands a block straight in its page and ``put`` sends a
page as is. The layout's name (:func:`block_layout`) goes into the namespace, so engines with another
layout, block size or head shape never share keys. Sliding layers keep no pages (see ``sliding.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.engine.config import ModelConfig


class CacheFullError(RuntimeError):
    """No free pages left for a sequence (the request needs a larger ``cache_tokens``)."""


def block_layout(config: ModelConfig, block_tokens: int) -> str:
    """The stored block layout's name, with every dimension in it."""
    g, h, d = len(config.global_layers), config.num_kv_heads, config.head_dim
    return f"kvtier.paged.v1[G{g}][KV2][T{block_tokens}][H{h}][D{d}]"


class PagePool:
    """A fixed pool of pages (``pages`` [num_pages, *page_shape]) on one device, handed out by :meth:`allocate` and
    taken back by :meth:`release`."""

    def __init__(
        self,
        num_pages: int,
        page_shape: tuple[int, ...],
        block_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.block_tokens = block_tokens
        self.pages = torch.zeros((num_pages, *page_shape), dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def page_bytes(self) -> int:
        return self.pages[0].numel() * self.pages.element_size()

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free pages, lowest first: on a cache not cut up by other requests, one run of consecutive pages,
        which a fetch through the store client fills with one copy (a page at a time otherwise)."""
        if n > len(self._free):
            raise CacheFullError(f"the paged cache needs {n} more pages, {len(self._free)} are free")
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def release(self, pages: Sequence[int]) -> None:
        """Give ``pages`` back. The free pages stay sorted, highest first, so the next ``allocate`` takes the lowest
        (appended as given back, a request's pages came out again descending: no run of two, a copy a page)."""
        self._free.extend(pages)
        self._free.sort(reverse=True)

    def block(self, page: int) -> torch.Tensor:
        """Page ``page`` as one flat byte tensor (a view: writing it writes the page)."""
        return self.pages[page].view(-1).view(torch.uint8)

    def block_run(self, first: int, n: int) -> torch.Tensor:
        """Pages ``first … first+n-1`` as ``uint8 [n, page_bytes]`` (a view: one copy fills them all)."""
        return self.pages[first : first + n].view(n, -1).view(torch.uint8)


class PagedKVCache(PagePool):
    """The dense families' pages: every global layer's keys and values (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        block_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.slot = {layer: g for g, layer in enumerate(config.global_layers)}
        shape = (len(self.slot), 2, block_tokens, config.num_kv_heads, config.head_dim)
        super().__init__(num_pages, shape, block_tokens, dtype, device)

    def write(self, layer: int, table: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` [T, kv_heads, head_dim] of global ``layer`` at ``positions`` of the sequence whose
        page table is ``table``."""
        page = table[positions // self.block_tokens]
        offset = positions % self.block_tokens
        g = self.slot[layer]
        self.pages[page, g, 0, offset] = k
        self.pages[page, g, 1, offset] = v

    def read(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 … length-1`` of global ``layer``, contiguous [length, kvh, d]."""
        n = -(-length // self.block_tokens)
        kv = self.pages[table[:n], self.slot[layer]]  # [n, 2, T, kvh, d]: a gather, one copy
        kv = kv.transpose(0, 1).flatten(1, 2)[:, :length]
        return kv[0], kv[1]
