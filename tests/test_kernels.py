"""The row copies and the row check equal their torch references bit for bit. The TileLang copy: compiled for the
CPU (``target="c"``, where tilelang is installed) and for CUDA (where a GPU is), rows of different strides on each
side, a flag holding the launch's stamp moves nothing (one holding another launch's stamp does not stop it); the
TileLang check (CUDA only) flags exactly the lists its reference refuses and hands every list on to the copy, launch
after launch with the same claims (CI has neither and skips those). The C host copy: streaming and plain
paths (long and short rows, aligned and unaligned destinations, tails that are not whole cache lines). The decoding
gather (``kernels/dequant.py``, C and CUDA): every kind of segment, random encoded bytes (every code, NaN and the
scale's range ends among them) decoded bit for bit as ``kvquant`` defines them."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kvtier.kernels import _hostcopy
from kvtier.kernels.dequant import DecodeRows
from kvtier.kernels.kvquant import Segment
from kvtier.kernels.rowcopy import RowCheckKernel, RowCopyKernel, copy_rows_reference, rows_ok_reference

needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TARGETS = ["c", pytest.param("cuda", marks=needs_cuda)]


def random_words(rows: int, width: int, device: str) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (rows, width), dtype=torch.int32, device=device)


def copy_case(src_stride: int, dst_stride: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random source rows, a poisoned destination (every row the kernel should not touch must survive) and 25
    random distinct rows of each."""
    src = random_words(40, src_stride, device)
    dst = random_words(64, dst_stride, device)
    rows = torch.stack([torch.randperm(40, device=device)[:25], torch.randperm(64, device=device)[:25]])
    return src, dst, rows.to(torch.int32)


@needs_tilelang
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("width", "src_stride", "dst_stride"), [(1024, 1024, 1024), (1024, 1152, 1024), (96, 96, 128)])
def test_kernel_equals_reference(target: str, width: int, src_stride: int, dst_stride: int) -> None:
    device = "cpu" if target == "c" else "cuda"
    src, dst, rows = copy_case(src_stride, dst_stride, device)
    want = dst.clone()
    copy_rows_reference(src, rows[0], want, rows[1])
    earlier = torch.full((1,), 3, dtype=torch.int32, device=device)  # an earlier launch (stamp 3) was refused
    RowCopyKernel(width, src_stride, dst_stride, target=target)(src, rows, dst, earlier, 4)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst, want)


@needs_tilelang
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["copy", "decode"])
def test_kernel_with_the_flag_set_moves_nothing(target: str, kind: str) -> None:
    device = "cpu" if target == "c" else "cuda"
    if kind == "copy":
        src, dst, rows = copy_case(1024, 1024, device)
        kernel = RowCopyKernel(1024, 1024, 1024, target=target)
    else:
        layout, src, dst, rows = decoding_case(torch.bfloat16, device)
        kernel = layout.kernel(src.shape[1] // 4, dst.shape[1] // 4, target=target)
        src, dst = src.view(torch.int32), dst.view(torch.int32)
    before = dst.clone()
    kernel(src, rows, dst, torch.full((1,), 7, dtype=torch.int32, device=device), 7)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst, before)


def check_cases() -> list[tuple[torch.Tensor, int, int]]:
    """Row lists with their source and destination row counts: good ones (sources may repeat) and one of each way to
    be bad, each bad entry at a random place of a good list; the repeats also far apart (in different CTAs)."""
    cases = [(torch.stack([torch.randint(0, 40, (64,)), torch.randperm(64)]), 40, 64) for _ in range(3)]
    for side, value in ((0, 40), (0, -1), (1, 64), (1, -5), (0, 2**31 - 1), (1, -(2**31))):
        rows = torch.stack([torch.randint(0, 40, (60,)), torch.randperm(64)[:60]])
        rows[side, torch.randint(0, 60, ())] = value
        cases.append((rows, 40, 64))
    for n in (60, 3000):
        dup = torch.stack([torch.randint(0, 40, (n,)), torch.randperm(4 * n)[:n]])
        dup[1, n - 1] = dup[1, 3]
        cases.append((dup, 40, 4 * n))
    return [(rows.to(torch.int32), src_count, dst_count) for rows, src_count, dst_count in cases]


@needs_tilelang
@needs_cuda
def test_check_kernel_flags_exactly_what_the_reference_refuses() -> None:
    check = RowCheckKernel()
    claims = torch.zeros(12000, dtype=torch.int32, device="cuda")
    for stamp, (rows, src_count, dst_count) in enumerate(check_cases() * 2, start=1):  # twice: earlier claims stay
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        verdict = torch.zeros(1, dtype=torch.int32, device="cuda")
        handed_on = torch.full_like(rows, -7, device="cuda")
        check(rows.cuda(), handed_on, verdict, flag, claims, src_count, dst_count, stamp)
        ok = rows_ok_reference(rows, src_count, dst_count)
        assert (flag.item(), verdict.item()) == ((0, 0) if ok else (stamp, 1)), rows
        assert torch.equal(handed_on.cpu(), rows)


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


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_narrow_ids_writes_the_ids_as_int32_at_the_offset(dtype: type) -> None:
    ids = np.random.default_rng(1).integers(-(2**31), 2**31, 1003).astype(dtype)  # not a multiple of the 4-id step
    dst = np.full(1100, -7, dtype=np.int32)
    assert _hostcopy.narrow_ids(dst, 5, ids) == -1
    assert np.array_equal(dst[5:1008], ids) and (dst[:5] == -7).all() and (dst[1008:] == -7).all()


@pytest.mark.parametrize("position", [0, 3, 4, 998])
@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**40, -(2**62)])
def test_narrow_ids_names_the_first_id_beyond_int32(position: int, value: int) -> None:
    ids = np.arange(999, dtype=np.int64)
    ids[position] = value
    ids[-1] = value + 1 if position < 998 else ids[-1]  # a later one too: the first is named
    assert _hostcopy.narrow_ids(np.zeros(999, dtype=np.int32), 0, ids) == position


def test_narrow_ids_refuses_other_types_and_overflow() -> None:
    dst = np.zeros(8, dtype=np.int32)
    with pytest.raises(TypeError, match="int32 destination"):
        _hostcopy.narrow_ids(dst, 0, np.arange(4, dtype=np.uint64))
    with pytest.raises(TypeError, match="int32 destination"):
        _hostcopy.narrow_ids(np.zeros(8, dtype=np.int64), 0, np.arange(4))
    with pytest.raises(ValueError, match="do not fit"):
        _hostcopy.narrow_ids(dst, 5, np.arange(4))


# --- the decoding gather (kernels/dequant.py) --------------------------------------------------------------------


def decoding_layout(dtype: torch.dtype) -> DecodeRows:
    """Every kind the kernel decodes, at offsets and strides a block has: 5 rows of 64 values as fp8-e4m3 (48) +
    bf16 (16, the RoPE channels) and exact rows, 3 rows each of mxfp8 and mxfp4 (rows past a segment's end: a
    segment's last tile is partial)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    segments, src, dst = [], 0, 0
    for codec, rows, width, first, row_width in (
        ("fp8-e4m3", 5, 48, 0, 64),
        ("bf16", 5, 16, 48, 64),
        ("mxfp8", 3, 64, 0, 64),
        ("mxfp4", 3, 64, 0, 64),
        ("exact", 7, 40, 0, 40),
        ("mxfp8", 1200, 32, 0, 32),  # more than one tile
    ):
        if first == 0 and segments:
            dst += segments[-1].rows * segments[-1].dst_row_stride
        s = Segment(codec, rows, width, itemsize, src, dst + first * itemsize, row_width * itemsize)
        segments.append(s)
        src += s.encoded_bytes
    return DecodeRows(tuple(segments), dtype)


def decoding_case(dtype: torch.dtype, device: str) -> tuple[DecodeRows, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random encoded rows (every element and scale code, NaN and the range ends included), a poisoned destination
    and 9 rows of each, in random order."""
    layout = decoding_layout(dtype)
    src_stride = -(-layout.src_bytes // 64) * 64 + 64
    src = torch.randint(0, 256, (12, src_stride), dtype=torch.uint8, device=device)
    dst = torch.randint(0, 256, (16, layout.dst_bytes + 256), dtype=torch.uint8, device=device)
    rows = torch.stack([torch.randperm(12, device=device)[:9], torch.randperm(16, device=device)[:9]])
    return layout, src, dst, rows.to(torch.int32)


@needs_tilelang
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoding_kernel_equals_reference(target: str, dtype: torch.dtype) -> None:
    device = "cpu" if target == "c" else "cuda"
    layout, src, dst, rows = decoding_case(dtype, device)
    want = dst.clone()
    want[rows[1].long(), : layout.dst_bytes] = layout.reference(src[rows[0].long()])
    kernel = layout.kernel(src.shape[1] // 4, dst.shape[1] // 4, target=target)
    kernel(src.view(torch.int32), rows, dst.view(torch.int32), torch.full((1,), 3, dtype=torch.int32, device=device), 4)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst, want)


def test_a_decoding_layout_the_kernel_cannot_take_is_refused() -> None:
    odd = Segment("fp8-e4m3", 2, 16, 2, 0, 2, 34)  # rows that start mid-word
    with pytest.raises(ValueError, match="rows in whole words"):
        DecodeRows((odd,), torch.bfloat16).table()
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        DecodeRows((odd,), torch.float16)
