"""The TileLang row-copy kernel equals its torch reference bit for bit: compiled for the CPU (``target="c"``, where
tilelang is installed) and for CUDA (where a GPU is), gathering into scattered rows and scattering back, with
source and destination rows of different strides. CI has neither tilelang nor a GPU and skips them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

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
