"""A CPU host KV pool with the page geometry of SGLang's ``MHATokenToKVPoolHost``, for kvbench and the tests.

SGLang's own host pools (``sglang.srt.mem_cache.pool_host``) cannot be imported on a CPU-only machine: the package
imports ``sglang.srt.configs``, which imports ``torchvision`` at module level, and PyPI's torchvision wheels link
``libtorch_cuda.so`` (CPU builds are published only on PyTorch's own index). This pool keeps the parts of that
class's contract a storage backend sees (sglang 0.5.23, ``pool_host/mha.py``): K and V planes of
``(2, size, layers, heads, head_dim)`` in the ``page_first`` layout or ``(2, layers, size, heads, head_dim)`` in
``layer_first``; ``get_page_buffer_meta(indices)`` naming, per page, K then V (``page_first``) or K and V of
every layer in turn (``layer_first``); ``get_data_page``/``set_from_flat_data_page`` for the older interface.
With ``allocator="shm"`` the planes live in a memfd from SGLang's own ``alloc_shm``, as SGLang allocates them
for ``"allocator": "shm"``.
"""

from __future__ import annotations

import torch

LAYOUTS = ("page_first", "layer_first")


class HostPool:
    """``size`` token slots of ``layers`` × ``heads`` × ``head_dim`` K and V values, in pages of ``page_size``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        layout: str = "page_first",
        allocator: str = "default",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if size % page_size:
            raise ValueError(f"size {size} is not a whole number of pages of {page_size}")
        self.size, self.page_size, self.layout, self.dtype = size, page_size, layout, dtype
        self.layer_num, self.head_num, self.head_dim = layers, heads, head_dim
        self.size_per_token = 2 * layers * heads * head_dim * dtype.itemsize
        dims = (2, size, layers, heads, head_dim) if layout == "page_first" else (2, layers, size, heads, head_dim)
        self.fd: int | None = None
        if allocator == "shm":
            from sglang.srt.mem_cache.storage.mmap import alloc_shm

            self.kv_buffer, self.fd, self._mm = alloc_shm(dims, dtype)
        else:
            self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointers and byte sizes of every page's K and V buffers (SGLang's zero-copy storage metadata)."""
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        row = self.head_num * self.head_dim * item  # one token of one layer
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * row
        starts = indices.tolist()[:: self.page_size]
        pointers: list[int] = []
        if self.layout == "page_first":
            for start in starts:
                k = base + start * self.layer_num * row
                pointers += [k, k + v_offset]
            size = self.layer_num * self.page_size * row
        else:
            for start in starts:
                for layer in range(self.layer_num):
                    k = base + start * row + layer * self.size * row
                    pointers += [k, k + v_offset]
            size = self.page_size * row
        return pointers, [size] * len(pointers)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "page_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        else:
            page = self.kv_buffer[:, :, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.size_per_token * self.page_size // self.dtype.itemsize, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.get_data_page(index, flat=False).copy_(data_page.reshape(self.get_data_page(index, flat=False).shape))

    def page_bytes(self, index: int) -> bytes:
        """Page ``index``'s K and V values as bytes (what the tests compare)."""
        return self.get_data_page(index).contiguous().view(torch.uint8).numpy().tobytes()

    def fill(self, generator: torch.Generator) -> None:
        """Random values in every slot (as random bits, so every byte matters)."""
        raw = self.kv_buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
