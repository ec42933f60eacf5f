"""Indexed row copy: ``dst[dst_rows[b], :width] = src[src_rows[b], :width]`` for every ``b``, in one launch.

This one kernel is both directions of swap-in: a *gather* from host staging slots into scattered KV-cache pages,
and a *scatter* from pages back into slots for swap-out. Rows are 32-bit words (callers view their bytes as
``int32``), so one thread moves 16 bytes per access when the row width allows.

``copy_rows_reference`` is the torch definition every kernel is tested against, bit for bit. ``RowCopyKernel`` is
the TileLang version: one CTA per row, the row spread over its threads with ``T.Parallel``. On a GPU its source
rows may be host memory mapped into the device's address space (``cudaHostRegister``): the kernel then reads them
across PCIe itself and writes each destination row where it belongs, with no copy engine call per row and no
staging copy on the device. Compiled for ``target="c"`` the same kernel runs on CPU tensors, which lets a machine
without a GPU check the kernel's indexing.

Contract of both: ``src`` and ``dst`` are 2-D ``int32`` tensors with contiguous rows; ``src_rows`` and ``dst_rows``
are 1-D ``int64`` tensors of equal length on the tensors' device, every index in range and ``dst_rows`` free of
repeats (a repeated destination row would receive one of its sources, unspecified which). Checking that is the
caller's job: the kernel silently skips out-of-range rows. Nothing here imports kvtier; tilelang is imported only
when a kernel is built.

No ``from __future__ import annotations`` here: TileLang evaluates the kernel's annotations, which name local
variables.
"""

import functools
from typing import Any

import torch

WORD_BYTES = 4
DEFAULT_THREADS = 256


def copy_rows_reference(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """The definition: ``dst[dst_rows[b], :w] = src[src_rows[b], :w]`` with ``w = min`` of the two row widths."""
    width = min(src.shape[1], dst.shape[1])
    dst[:, :width].index_copy_(0, dst_rows, src[:, :width].index_select(0, src_rows))


@functools.cache
def _compiled(width: int, src_stride: int, dst_stride: int, threads: int, target: str) -> Any:
    import tilelang
    import tilelang.language as T

    n = T.dynamic("n")
    src_count = T.dynamic("src_count")
    dst_count = T.dynamic("dst_count")

    @T.prim_func
    def copy_rows(
        src: T.Tensor((src_count, src_stride), "int32"),
        src_rows: T.Tensor((n,), "int64"),
        dst_rows: T.Tensor((n,), "int64"),
        dst: T.Tensor((dst_count, dst_stride), "int32"),
    ):
        with T.Kernel(n, threads=threads) as b:
            s = src_rows[b]
            d = dst_rows[b]
            for i in T.Parallel(width):
                dst[d, i] = src[s, i]

    return tilelang.compile(copy_rows, target=target)


class RowCopyKernel:
    """The TileLang row copy for rows of ``width`` words, source rows ``src_stride`` words apart and destination rows
    ``dst_stride`` apart. Built (compiled, then cached per shape for the process) on first construction; raises
    ``ImportError`` without tilelang and tilelang's own error when the target has no compiler."""

    def __init__(
        self, width: int, src_stride: int, dst_stride: int, threads: int = DEFAULT_THREADS, target: str = "cuda"
    ) -> None:
        if not 0 < width <= min(src_stride, dst_stride):
            raise ValueError(f"row width {width} must be positive and fit both strides ({src_stride}, {dst_stride})")
        self.width = width
        self._kernel = _compiled(width, src_stride, dst_stride, threads, target)

    def __call__(self, src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Launch on the current stream; returns without waiting for the copy."""
        self._kernel(src, src_rows, dst_rows, dst)
