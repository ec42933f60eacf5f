"""Indexed row copy: ``dst[dst_rows[b], :width] = src[src_rows[b], :width]`` for every ``b``, in one launch, and the
check that makes it all-or-nothing.

This one kernel is both directions of swap-in: a *gather* from host staging slots into scattered KV-cache pages,
and a *scatter* from pages back into slots for swap-out. Rows are 32-bit words (callers view their bytes as
``int32``), so one thread moves 16 bytes per access when the row width allows.

``copy_rows_reference`` and ``rows_ok_reference`` are the torch definitions every kernel is tested against, bit for
bit. ``RowCopyKernel`` is the TileLang copy: one CTA per row, the row spread over its threads with ``T.Parallel``.
On a GPU its source rows may be host memory mapped into the device's address space (``cudaHostRegister``): the
kernel then reads them across PCIe itself and writes each destination row where it belongs, with no copy engine
call per row and no staging copy on the device. ``RowCheckKernel`` checks the row lists on the device, in the same
stream, just before the copy (bounds, and no destination row twice): its verdict is a flag word the copy reads
first, so a bad list moves no byte and the host learns why without having walked the lists itself. Compiled for
``target="c"`` the copy runs on CPU tensors, which lets a machine without a GPU check its indexing.

Shared contract: ``rows`` is one contiguous ``int32`` tensor ``[2, n]`` on the tensors' device, source rows in
``rows[0]`` and destination rows in ``rows[1]`` (int32: half the bytes of int64 for the host to write and the
device to read; the copy widens a row to int64 before it multiplies by the stride, so tables of over 2**31 words are
fine); ``flag`` an ``int32`` tensor ``[1]`` there and ``stamp`` a positive ``int32`` naming the launch. The copy
moves nothing if ``flag[0] == stamp``; otherwise it trusts the rows (an out-of-range row is skipped, a repeated
destination row receives one of its sources, unspecified which). The check reads the lists from ``ids`` (same
layout; on a GPU it may be host memory mapped into the device, so the lists need no upload), writes them to ``rows``
for the copy, and when a row is out of range or a destination row repeats sets ``flag[0] = stamp`` and
``verdict[0] = 1`` (an ``int32`` word the host can read, normally mapped host memory); it clears neither. So no
flag word needs clearing between launches: a flag word holds the stamp of a refused launch, which no other launch
uses. Nothing here imports kvtier; tilelang is imported only when a kernel is built.

No ``from __future__ import annotations`` here: TileLang evaluates the kernels' annotations, which name local
variables.
"""

import functools
from typing import Any

import torch

WORD_BYTES = 4
DEFAULT_THREADS = 256
CHECK_THREADS = 256
STAMP_LIMIT = 2**31 - 1  # stamps are int32 (TileLang's returning atomic max is 32-bit)


def copy_rows_reference(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """The definition: ``dst[dst_rows[b], :w] = src[src_rows[b], :w]`` with ``w = min`` of the two row widths."""
    width = min(src.shape[1], dst.shape[1])
    dst[:, :width].index_copy_(0, dst_rows.long(), src[:, :width].index_select(0, src_rows.long()))


def rows_ok_reference(rows: torch.Tensor, src_count: int, dst_count: int) -> bool:
    """The definition of the check: every source row in ``[0, src_count)``, every destination row in
    ``[0, dst_count)``, no destination row twice."""
    src_rows, dst_rows = rows[0], rows[1]
    in_range = bool(((src_rows >= 0) & (src_rows < src_count) & (dst_rows >= 0) & (dst_rows < dst_count)).all())
    return in_range and torch.unique(dst_rows).numel() == dst_rows.numel()


@functools.cache
def _copy(width: int, src_stride: int, dst_stride: int, threads: int, target: str) -> Any:
    import tilelang
    import tilelang.language as T

    n = T.dynamic("n")
    src_count = T.dynamic("src_count")
    dst_count = T.dynamic("dst_count")

    @T.prim_func
    def copy_rows(
        src: T.Tensor((src_count, src_stride), "int32"),
        rows: T.Tensor((2, n), "int32"),
        flag: T.Tensor((1,), "int32"),
        dst: T.Tensor((dst_count, dst_stride), "int32"),
        stamp: T.int32,
    ):
        with T.Kernel(n, threads=threads) as b:
            if flag[0] != stamp:
                s = T.cast(rows[0, b], "int64")
                d = T.cast(rows[1, b], "int64")
                for i in T.Parallel(width):
                    dst[d, i] = src[s, i]

    return _entry(tilelang.compile(copy_rows, target=target))


@functools.cache
def _check(threads: int, target: str) -> Any:
    import tilelang
    import tilelang.language as T

    n = T.dynamic("n")
    claim_count = T.dynamic("claim_count")

    @T.prim_func
    def check_rows(
        ids: T.Tensor((2, n), "int32"),
        rows: T.Tensor((2, n), "int32"),
        verdict: T.Tensor((1,), "int32"),
        flag: T.Tensor((1,), "int32"),
        claims: T.Tensor((claim_count,), "int32"),
        src_count: T.int32,
        dst_count: T.int32,
        stamp: T.int32,
    ):
        with T.Kernel(T.ceildiv(n, threads), threads=threads) as block:
            b = block * threads + T.get_thread_binding()
            if b < n:
                s = ids[0, b]
                d = ids[1, b]
                rows[0, b] = s
                rows[1, b] = d
                if s < 0 or s >= src_count or d < 0 or d >= dst_count:
                    flag[0] = stamp
                    verdict[0] = 1
                elif T.atomic_max(claims[d], stamp, return_prev=True) == stamp:
                    flag[0] = stamp  # another row of this launch claimed d first
                    verdict[0] = 1

    return _entry(tilelang.compile(check_rows, target=target))


def _entry(kernel: Any) -> Any:
    """The compiled function itself (TileLang's TVM-FFI executable's ``main``), called with every parameter in
    order: these kernels have no outputs, so the Python wrapper's work per call (matching parameters, allocating
    outputs) is skipped. The wrapper itself where the backend offers no such executable."""
    executable = getattr(getattr(kernel, "adapter", None), "get_exportable_executable", None)
    if executable is None:
        return kernel
    module = executable()  # a fresh build's Executable, or the module loaded from TileLang's kernel cache
    return (module.jit() if hasattr(type(module), "jit") else module).main


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
        self._kernel = _copy(width, src_stride, dst_stride, threads, target)

    def __call__(
        self, src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor, stamp: int
    ) -> None:
        """Launch on the current stream; returns without waiting for the copy. Copies nothing if ``flag[0] == stamp``
        when the kernel runs."""
        self._kernel(src, rows, flag, dst, stamp)


class RowCheckKernel:
    """The TileLang check of the lists in ``ids`` against ``src_count`` source and ``dst_count`` destination rows,
    copying them into ``rows`` (CUDA only: it needs a returning atomic).

    Repeats are found with ``claims``, an ``int32`` tensor of at least ``dst_count`` words on the device, zero when
    first used, and a ``stamp`` larger than every stamp used with those claims before (so no claim needs clearing
    between launches; at ``STAMP_LIMIT`` zero the claims and start again from 1). Launches using one ``claims``
    must be ordered (one stream)."""

    def __init__(self, threads: int = CHECK_THREADS, target: str = "cuda") -> None:
        self._kernel = _check(threads, target)

    def __call__(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        verdict: torch.Tensor,
        flag: torch.Tensor,
        claims: torch.Tensor,
        src_count: int,
        dst_count: int,
        stamp: int,
    ) -> None:
        """Launch on the current stream; returns without waiting. ``rows`` receives ``ids``; if they are bad, sets
        ``flag[0] = stamp`` and ``verdict[0] = 1``."""
        self._kernel(ids, rows, verdict, flag, claims, src_count, dst_count, stamp)
