"""Swap-in / swap-out between slots of a real shared-memory segment and a paged KV cache: bytes land in the
named pages (or slots) and nowhere else, bad arguments are refused before a byte moves. The GPU cases run only
where CUDA and tilelang are present (the lent H200); CI skips them."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from kvtier.kernels.dequant import DecodeRows
from kvtier.kernels.kvquant import Segment
from kvtier.kernels.rowcopy import copy_rows_reference
from kvtier.transfer import staging
from kvtier.transfer.swapin import CudaHostMapping, SwapError, slot_tensor, swap_in, swap_out

SLOTS = 12
STRIDE = 4096 + 512  # slots wider than pages: the tail of a slot must survive a swap-out
PAGE_SHAPE = (2, 4, 8, 32)  # K and V, 4 heads, 8 tokens, head dim 32, bf16: 4 KiB a page
PAGES = 16
OFFSET = 4096  # the slot table sits in front of the slot data in the staging pool's segment

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("tilelang") is None,
    reason="needs a CUDA device and tilelang",
)


@pytest.fixture
def segment() -> Iterator[shared_memory.SharedMemory]:
    shm = shared_memory.SharedMemory(create=True, size=OFFSET + SLOTS * STRIDE)
    try:
        yield shm
    finally:
        shm.close()
        shm.unlink()


def page_bytes() -> int:
    return int(np.prod(PAGE_SHAPE)) * 2


@pytest.fixture
def slots(segment: shared_memory.SharedMemory) -> Iterator[torch.Tensor]:
    view = slot_tensor(segment.buf, stride=STRIDE, slots=SLOTS, offset=OFFSET)
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8))
    yield view
    del view  # the segment closes only once no view exports its buffer


def random_cache(device: str = "cpu") -> torch.Tensor:
    """Random bit patterns, never zeros, so an unwritten or misplaced page shows."""
    words = torch.randint(-(2**15), 2**15, (PAGES, *PAGE_SHAPE), dtype=torch.int16)
    return words.view(torch.bfloat16).to(device)


def expected_swap_in(slots: torch.Tensor, slot_ids: list[int], cache: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """The torch reference's answer, computed on CPU copies."""
    out = cache.cpu().clone()
    rows = out.view(PAGES, -1).view(torch.uint8)
    copy_rows_reference(slots.cpu(), torch.tensor(slot_ids), rows, torch.tensor(pages))
    return out


def decoder() -> DecodeRows:
    """A page (bf16, rows of 32 values) kept as fp8-e4m3, the last 16 channels of each row as bf16: 3,136 bytes."""
    rows = page_bytes() // 64
    nope = Segment("fp8-e4m3", rows, 16, 2, 0, 0, 64)
    return DecodeRows((nope, Segment("bf16", rows, 16, 2, nope.encoded_bytes, 32, 64)), torch.bfloat16)


def expected_decoded(slots: torch.Tensor, slot_ids: list[int], cache: torch.Tensor, pages: list[int]) -> torch.Tensor:
    out = cache.cpu().clone()
    out.view(PAGES, -1).view(torch.uint8)[pages] = decoder().reference(slots.cpu()[slot_ids])
    return out


def test_slot_tensor_views_the_segment_without_copying(segment: shared_memory.SharedMemory) -> None:
    view = slot_tensor(segment.buf, stride=STRIDE, slots=SLOTS, offset=OFFSET)
    view[3, 7] = 201
    assert segment.buf[OFFSET + 3 * STRIDE + 7] == 201
    del view


def test_swap_in_reads_blocks_the_staging_pool_holds_through_a_read_only_mapping() -> None:
    pool = staging.StagingPool.create("kvtier-swapin", capacity_bytes=6 * page_bytes(), slot_bytes=page_bytes())
    fd = staging.read_only(pool.fd)
    engine = staging.SlotMap.open(fd)  # the engine's mapping of the fetcher's segment: read-only, as it gets it
    os.close(fd)
    try:
        blocks = {page: os.urandom(page_bytes()) for page in (7, 1, 12)}
        slot_ids = []
        for block in blocks.values():
            slot, _generation = pool.reserve(os.getpid())
            pool.view(slot)[:] = block
            slot_ids.append(slot)
        slots = slot_tensor(engine.buffer, stride=engine.stride, slots=engine.slots, offset=engine.data_offset)
        cache = random_cache()
        swap_in(slots, slot_ids, cache, list(blocks))
        del slots
        for page, block in blocks.items():
            assert cache[page].view(-1).view(torch.uint8).numpy().tobytes() == block
    finally:
        engine.close()
        pool.close()


def test_swap_in_puts_each_slot_into_its_page_and_touches_no_other(slots: torch.Tensor) -> None:
    cache = random_cache()
    slot_ids, page_ids = [5, 0, 11, 3], [9, 2, 15, 0]
    want = expected_swap_in(slots, slot_ids, cache, page_ids)
    swap_in(slots, slot_ids, cache, page_ids)
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))
    assert torch.equal(cache[9].view(-1).view(torch.uint8), slots[5, : page_bytes()])


def test_swap_out_then_in_round_trips_and_keeps_the_slot_tails(slots: torch.Tensor) -> None:
    cache = random_cache()
    tails = slots[:, page_bytes() :].clone()
    swap_out(cache, np.array([4, 7, 1]), slots, torch.tensor([10, 2, 6]))
    assert torch.equal(slots[:, page_bytes() :], tails)
    back = random_cache()
    swap_in(slots, [10, 2, 6], back, [4, 7, 1])
    assert torch.equal(back[[4, 7, 1]].view(torch.int16), cache[[4, 7, 1]].view(torch.int16))


def test_swap_in_with_a_decoder_puts_each_slot_decoded_into_its_page(slots: torch.Tensor) -> None:
    cache = random_cache()
    slot_ids, page_ids = [5, 0, 11, 3], [9, 2, 15, 0]
    want = expected_decoded(slots, slot_ids, cache, page_ids)
    swap_in(slots, slot_ids, cache, page_ids, decode=decoder())
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))


def test_a_decoder_of_other_pages_or_larger_blocks_is_refused(slots: torch.Tensor) -> None:
    small = random_cache()[:, :1].contiguous()  # pages of 2 KiB
    with pytest.raises(SwapError, match="the decoder makes 4096-byte pages, the cache's are 2048 bytes"):
        swap_in(slots, [1], small, [0], decode=decoder())
    with pytest.raises(SwapError, match="a block is 3136 bytes, more than a slot's 1024"):
        swap_in(slots[:, :1024].contiguous(), [1], random_cache(), [0], decode=decoder())


def test_no_ids_is_a_no_op(slots: torch.Tensor) -> None:
    cache = random_cache()
    before = cache.clone()
    swap_in(slots, [], cache, [])
    assert torch.equal(cache.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize(
    ("slot_ids", "page_ids", "message"),
    [
        ([0, SLOTS], [0, 1], "slot id 12 out of range"),
        ([0, 1], [-1, 1], "page id -1 out of range"),
        ([0, 1], [3, 3], "page id 3 repeats"),
        ([0, 2**32], [0, 1], "slot id 4294967296 out of range"),
        ([0, 1, 2], [0, 1], "3 slot ids but 2 page ids"),
        ([0.5], [0], "slot ids must be a 1-D sequence of integers"),
        ([[0, 1]], [0, 1], "slot ids must be a 1-D sequence of integers"),
    ],
)
def test_bad_ids_are_refused_before_any_copy(slots: torch.Tensor, slot_ids, page_ids, message: str) -> None:
    cache = random_cache()
    before = cache.clone()
    with pytest.raises(SwapError, match=message):
        swap_in(slots, slot_ids, cache, page_ids)
    assert torch.equal(cache.view(torch.int16), before.view(torch.int16))


def test_swap_out_refuses_two_pages_into_one_slot(slots: torch.Tensor) -> None:
    before = slots.clone()
    with pytest.raises(SwapError, match="slot id 4 repeats"):
        swap_out(random_cache(), [0, 1], slots, [4, 4])
    assert torch.equal(slots, before)


def test_a_page_larger_than_a_slot_is_refused(slots: torch.Tensor) -> None:
    with pytest.raises(SwapError, match="more than a slot"):
        swap_in(slots, [0], torch.zeros(2, STRIDE + 4, dtype=torch.uint8), [0])


def test_a_non_contiguous_cache_is_refused(slots: torch.Tensor) -> None:
    with pytest.raises(SwapError, match="must be contiguous"):
        swap_in(slots, [0], random_cache().transpose(1, 2), [0])


def test_slots_that_do_not_fit_the_buffer_are_refused(segment: shared_memory.SharedMemory) -> None:
    with pytest.raises(SwapError, match="do not fit"):
        slot_tensor(segment.buf, stride=STRIDE, slots=SLOTS + 1, offset=OFFSET)


@gpu
@pytest.mark.parametrize("decoding", [False, True])
def test_gpu_swap_in_reads_the_registered_segment_directly(slots: torch.Tensor, decoding: bool) -> None:
    """Pages land as the slots hold them, or (``decode=``) decoded bit for bit as the torch reference decodes them."""
    cache = random_cache("cuda")
    slot_ids, page_ids = [5, 0, 11, 3, 7], [9, 2, 15, 0, 4]
    want = (expected_decoded if decoding else expected_swap_in)(slots, slot_ids, cache, page_ids)
    with CudaHostMapping(slots) as mapped:
        assert mapped.tensor.is_cuda
        assert mapped.tensor.data_ptr() == slots.data_ptr()  # an alias of host memory, not a device copy
        swap_in(mapped.tensor, slot_ids, cache, page_ids, decode=decoder() if decoding else None)
        torch.cuda.synchronize()
    assert torch.equal(cache.cpu().view(torch.int16), want.view(torch.int16))


@gpu
def test_gpu_swap_out_writes_the_segment_in_place(slots: torch.Tensor) -> None:
    cache = random_cache("cuda")
    tails = slots[:, page_bytes() :].clone()
    with CudaHostMapping(slots) as mapped:
        swap_out(cache, [4, 7, 1], mapped.tensor, [10, 2, 6])
        torch.cuda.synchronize()
    for page, slot in ((4, 10), (7, 2), (1, 6)):
        assert torch.equal(slots[slot, : page_bytes()], cache[page].cpu().view(-1).view(torch.uint8))
    assert torch.equal(slots[:, page_bytes() :], tails)


@gpu
@pytest.mark.parametrize(
    ("slot_ids", "page_ids", "message"),
    [
        ([0, SLOTS], [0, 1], "slot id 12 out of range"),
        ([0, 1], [-1, 1], "page id -1 out of range"),
        ([0, 1, 2], [3, 9, 3], "page id 3 repeats"),
        ([0, 2**32 + 1], [3, 9], "slot id 4294967297 out of range"),  # int32 on the device: refused on the host
        (np.array([1, 2], dtype=np.int32), np.array([5, -(2**31)], dtype=np.int32), "page id -2147483648 out of"),
    ],
)
def test_gpu_bad_ids_are_refused_and_nothing_moves(slots: torch.Tensor, slot_ids, page_ids, message: str) -> None:
    cache = random_cache("cuda")
    before = cache.clone()
    with CudaHostMapping(slots) as mapped:
        with pytest.raises(SwapError, match=message):
            swap_in(mapped.tensor, slot_ids, cache, page_ids)
        torch.cuda.synchronize()
        assert torch.equal(cache.view(torch.int16), before.view(torch.int16))
        swap_in(mapped.tensor, [1, 2], cache, [3, 9])  # the next call is checked on its own
        torch.cuda.synchronize()
    assert torch.equal(cache[3].cpu().view(-1).view(torch.uint8), slots[1, : page_bytes()])


@gpu
def test_gpu_swap_in_takes_int32_ids_and_queues_on_the_callers_stream(slots: torch.Tensor) -> None:
    cache = random_cache("cuda")
    slot_ids, page_ids = np.array([5, 0, 11], dtype=np.int32), torch.tensor([9, 2, 15], dtype=torch.int32)
    want = expected_swap_in(slots, slot_ids.tolist(), cache, page_ids.tolist())
    before, stream = cache.cpu(), torch.cuda.Stream()
    with CudaHostMapping(slots) as mapped, torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the copy waits behind this on the caller's stream
        swap_in(mapped.tensor, slot_ids, cache, page_ids)
        assert torch.cuda.current_stream() == stream  # the call leaves the caller's stream current
        with torch.cuda.stream(torch.cuda.default_stream()):
            meanwhile = cache.cpu()  # the default stream does not wait for the caller's
        stream.synchronize()
    assert torch.equal(meanwhile.view(torch.int16), before.view(torch.int16))
    assert torch.equal(cache.cpu().view(torch.int16), want.view(torch.int16))


@gpu
def test_gpu_calls_queued_behind_slow_work_move_exactly_the_served_ones(slots: torch.Tensor) -> None:
    """Refused and served calls, more than there are flag words, all checked while their copies still wait behind
    work on the stream: every refused call raises and moves nothing, every served one lands."""
    cache = random_cache("cuda")
    want = cache.cpu().clone()
    with CudaHostMapping(slots) as mapped:
        torch.cuda._sleep(100_000_000)  # tens of milliseconds: the copies below run only after every check
        for k in range(200):
            page = k % PAGES
            if k % 3 == 0:
                with pytest.raises(SwapError, match=f"page id {page} repeats"):
                    swap_in(mapped.tensor, [0, 1], cache, [page, page])
            else:
                swap_in(mapped.tensor, [k % SLOTS], cache, [page])
                want = expected_swap_in(slots, [k % SLOTS], want, [page])
        torch.cuda.synchronize()
    assert torch.equal(cache.cpu().view(torch.int16), want.view(torch.int16))


@gpu
def test_gpu_swap_out_refuses_two_pages_into_one_slot(slots: torch.Tensor) -> None:
    before = slots.clone()
    with CudaHostMapping(slots) as mapped:
        with pytest.raises(SwapError, match="slot id 4 repeats"):
            swap_out(random_cache("cuda"), [0, 1], mapped.tensor, [4, 4])
        torch.cuda.synchronize()
    assert torch.equal(slots, before)


@gpu
def test_gpu_cache_with_unmapped_slots_is_refused(slots: torch.Tensor) -> None:
    with pytest.raises(SwapError, match="map the slots with CudaHostMapping"):
        swap_in(slots, [0], random_cache("cuda"), [0])


@gpu
def test_gpu_swap_in_reads_a_sealed_segment_through_its_read_only_mapping() -> None:
    """How an engine sees the fetcher's cache segments: mapped read-only from a sealed memory file, registered with
    ``cudaHostRegisterReadOnly``; the gather kernel reads it like any other."""
    pool = staging.StagingPool.create("kvtier-swapin-gpu", capacity_bytes=6 * page_bytes(), slot_bytes=page_bytes())
    fd = staging.read_only(pool.fd)
    engine = staging.SlotMap.open(fd)
    os.close(fd)
    try:
        blocks = [os.urandom(page_bytes()) for _ in range(3)]
        for block in blocks:
            slot, _generation = pool.reserve(os.getpid())
            pool.view(slot)[:] = block
        rows = slot_tensor(engine.buffer, stride=engine.stride, slots=engine.slots, offset=engine.data_offset)
        cache = random_cache("cuda")
        with CudaHostMapping(rows, read_only=True) as mapped:
            swap_in(mapped.tensor, [0, 1, 2], cache, [5, 0, 9])
            torch.cuda.synchronize()
        del rows
        for page, block in zip((5, 0, 9), blocks, strict=True):
            assert cache[page].cpu().view(-1).view(torch.uint8).numpy().tobytes() == block
    finally:
        engine.close()
        pool.close()
