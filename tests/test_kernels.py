"""The row copies equal their torch reference bit for bit. The TileLang kernel: compiled for the CPU
(``target="c"``, where tilelang is installed) and for CUDA (where a GPU is), rows of different strides on each
side (CI has neither and skips those). The C host copy: streaming and plain paths (long and short rows, aligned
and unaligned destinations, tails that are not whole cache lines)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvtier.kernels import _hostcopy
from kvtier.kernels.rowcopy import RowCopyKernel, copy_rows_reference

needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")

TARGETS = [
    "c",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def random_words(rows: int, width: int, device: str) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (rows, width), dtype=torch.int32, device=device)


@needs_tilelang
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("width", "src_stride", "dst_stride"), [(1024, 1024, 1024), (1024, 1152, 1024), (96, 96, 128)])
def test_kernel_equals_reference(target: str, width: int, src_stride: int, dst_stride: int) -> None:
    device = "cpu" if target == "c" else "cuda"
    src = random_words(40, src_stride, device)
    dst = random_words(64, dst_stride, device)  # poisoned: every row the kernel should not touch must survive
    src_rows = torch.randperm(40, device=device)[:25]
    dst_rows = torch.randperm(64, device=device)[:25]
    want = dst.clone()
    copy_rows_reference(src, src_rows, want, dst_rows)
    RowCopyKernel(width, src_stride, dst_stride, target=target)(src, src_rows, dst, dst_rows)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst, want)


def test_a_row_wider_than_a_stride_is_refused() -> None:
    with pytest.raises(ValueError, match="must be positive and fit both strides"):
        RowCopyKernel(1025, 1024, 2048, target="c")


ROW_CASES = [(16384, 0), (2 * 16384 + 3 * 64 + 5, 0), (4096 + 48, 0), (512, 0), (4096, 4)]  # (bytes, misalignment)


@pytest.mark.parametrize(("nbytes", "dst_offset"), ROW_CASES)
def test_host_copy_equals_reference(nbytes: int, dst_offset: int) -> None:
    pitch = nbytes + 16
    src = torch.randint(0, 256, (40, nbytes + 64), dtype=torch.uint8)
    backing = torch.randint(0, 256, (dst_offset + 64 * pitch,), dtype=torch.uint8)
    dst = backing[dst_offset:].view(64, pitch)
    src_rows, dst_rows = torch.randperm(40)[:25], torch.randperm(64)[:25]
    want = dst.clone()
    copy_rows_reference(src[:, :nbytes], src_rows, want[:, :nbytes], dst_rows)
    _hostcopy.copy_rows(dst.data_ptr(), pitch, dst_rows.numpy(), src.data_ptr(), src.shape[1], src_rows.numpy(), nbytes)
    assert torch.equal(dst, want)


def test_host_copy_refuses_row_lists_of_different_lengths() -> None:
    buf = torch.zeros(4, 64, dtype=torch.uint8)
    rows = torch.arange(3).numpy()
    with pytest.raises(ValueError, match="equal length"):
        _hostcopy.copy_rows(buf.data_ptr(), 64, rows, buf.data_ptr(), 64, rows[:2], 64)


@pytest.mark.parametrize(
    ("rows", "distinct", "first_bad"),
    [([3, 0, 2], True, -1), ([3, 0, 3], False, -1), ([3, 0, 3], True, 2), ([1, 4, -1], True, 1), ([0, -1], False, 1)],
)
def test_check_rows_names_the_first_bad_position(rows: list[int], distinct: bool, first_bad: int) -> None:
    assert _hostcopy.check_rows(torch.tensor(rows).numpy(), 4, distinct) == first_bad


def test_check_rows_writes_the_rows_it_checked_into_out() -> None:
    rows = torch.randperm(1000).numpy()
    out = torch.full((1000,), -7, dtype=torch.int64).numpy()
    assert _hostcopy.check_rows(rows, 1000, True, out) == -1
    assert (out == rows).all()


def test_check_rows_refuses_an_out_shorter_than_the_rows() -> None:
    with pytest.raises(ValueError, match="out is shorter"):
        _hostcopy.check_rows(torch.arange(4).numpy(), 4, True, torch.zeros(3, dtype=torch.int64).numpy())
