"""Swap-in and swap-out: blocks between host staging slots and a paged KV cache, one page per store block.

The slots are rows of a host buffer, normally the staging pool's shared-memory segment: ``slot_tensor`` views its
data region as a ``uint8`` tensor ``[slots, stride]`` without copying. The KV cache is any contiguous tensor
``[num_pages, ...]``; a page is ``kv_cache[p]``, whose bytes are one block. ``swap_in`` copies the first
page-size bytes of ``slots[slot_ids[b]]`` into page ``page_ids[b]`` for every ``b``; ``swap_out`` copies pages into
slots, leaving the rest of each slot untouched.

- **CPU** (the KV cache on the CPU): the slots' CPU view; all blocks in one call of a C loop without the GIL
  (``kvtier.kernels._hostcopy``: streaming stores, no read-for-ownership of the destination, the next row
  prefetched while a row is copied). On the H200 host, one thread, 16/64 KiB blocks: 0.91-1.0/0.94-1.04x one
  glibc ``memcpy`` of the same bytes (1.7x torch's contiguous ``copy_``), where torch's ``index_copy_`` over the
  same views (the reference) ran at 0.04-0.07x (docs/swapin.md).
- **GPU** (the KV cache on a CUDA device): the slots must be seen through a :class:`CudaHostMapping`, which
  page-locks the host memory (``cudaHostRegister``) and hands out a CUDA tensor aliasing it. The TileLang row-copy
  kernel (``kvtier.kernels.rowcopy``) then reads the slots across PCIe and writes each page where it belongs in one
  launch: no ``cudaMemcpy`` per block, no staging copy in device memory. Swap-out is the same kernel with the
  roles swapped (pages in HBM → slots in host memory). The ids are checked on the device, not by the host: the
  host writes them into a reused buffer of mapped host memory, from which ``RowCheckKernel``, on a side stream,
  reads them (no upload call), hands them on to the copy in device memory and flags the call if one is out of range
  or a destination repeats; the copy, queued on the current stream behind that check, reads the flag first and
  moves nothing if it is set. On the H200 (PCIe 5 x16), 16/64 KiB blocks, 1 GiB a call: 0.90/0.905-0.91x one
  contiguous pinned ``cudaMemcpyAsync`` of the same bytes end to end (128 MiB calls queued: 0.90-0.91/0.89-0.92x;
  the kernel alone 0.92-0.93x; the rest, about 0.3 ms a call, is host work before the copy is launched, half of it
  writing the ids), against 0.05-0.06/0.20-0.27x for a ``cudaMemcpyAsync`` per block (docs/swapin.md).

**Decoding on the way** (``swap_in(..., decode=)``, low-precision KV formats): the slots hold encoded blocks and each
page receives its block decoded. On the GPU one launch of ``kernels/dequant.py``'s kernel in place of the row copy
(same ids, same check, same flag): only the encoded bytes cross PCIe. On the CPU the decoder's torch definition. What
the bytes mean is the decoder's business: this module sees sizes and a kernel.

Both functions check their arguments and raise :class:`SwapError` (one line: what is wrong) having moved no byte:
ids must be integers in range, as many slot ids as page ids, destination ids distinct, page size within the slot
stride, a multiple of 4 bytes on the GPU, and the tensors on matching devices. On the GPU they return once the
device has checked the ids (they wait for that check, 0.4 ms after the call for a GiB of 16 KiB blocks on the
H200, but neither for the copy nor for work queued earlier on the current stream) and the copy is queued on the
current stream: synchronise (or record an event) before the slots are released or the pages read from another
stream. Calls on one device take turns (the mapped id buffer is reused).
"""

from __future__ import annotations

import mmap
import threading
import warnings
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.kernels import _hostcopy
from kvtier.kernels.rowcopy import STAMP_LIMIT, WORD_BYTES, RowCheckKernel, RowCopyKernel

_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_HOST_REGISTER_READ_ONLY = 0x8  # cudaHostRegisterReadOnly: the device only reads it (a read-only mapping)


class SwapError(ValueError):
    """Bad arguments to a swap; nothing was copied."""


def slot_tensor(buffer: Any, *, stride: int, slots: int, offset: int = 0) -> torch.Tensor:
    """The ``uint8`` tensor ``[slots, stride]`` over ``buffer[offset : offset + slots * stride]`` (any buffer: a
    segment's mapping, an ``mmap``, a numpy array). A view: no copy, and writes through it land in the buffer. A
    read-only buffer (a cache segment as engines map it) gives a tensor that must only be read (``swap_in``): a
    write through it faults. Raises :class:`SwapError` if the region does not fit the buffer."""
    if stride <= 0 or slots <= 0 or offset < 0:
        raise SwapError(f"slot geometry must be positive: stride={stride} slots={slots} offset={offset}")
    view = memoryview(buffer)
    if offset + slots * stride > view.nbytes:
        raise SwapError(f"{slots} slots of {stride} bytes from offset {offset} do not fit a {view.nbytes}-byte buffer")
    with warnings.catch_warnings():  # torch warns that it cannot mark a tensor read-only: the caller knows
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=slots * stride, offset=offset).view(slots, stride)


class _CudaArrayInterface:
    """Describes host memory as device memory to ``torch.as_tensor``; kept alive by the tensor made from it."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


class CudaHostMapping:
    """A contiguous CPU ``uint8`` tensor (normally from :func:`slot_tensor`) page-locked and mapped into a CUDA
    device's address space. ``tensor`` is a CUDA tensor of the same shape aliasing the same bytes: kernels read and
    write host memory through it, across PCIe. Raises :class:`SwapError` if the tensor is unsuitable and
    ``RuntimeError`` if CUDA refuses the registration.

    ``read_only``: the memory is mapped read-only (a cache segment as an engine maps it): registered with
    ``cudaHostRegisterReadOnly``, and the device must only read it (``swap_in``).

    ``close`` (or leaving the ``with``) waits for the device, then unregisters; ``tensor`` must not be used after
    it. A segment may be registered once per process at a time (CUDA refuses overlapping registrations)."""

    def __init__(
        self, host: torch.Tensor, device: torch.device | int | str | None = None, read_only: bool = False
    ) -> None:
        if host.device.type != "cpu" or host.dtype != torch.uint8 or not host.is_contiguous():
            raise SwapError("a CUDA host mapping needs a contiguous CPU uint8 tensor (see slot_tensor)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self._ptr = host.data_ptr()
        flags = _HOST_REGISTER_PORTABLE_MAPPED | (_HOST_REGISTER_READ_ONLY if read_only else 0)
        with torch.cuda.device(self.device):
            err = int(torch.cuda.cudart().cudaHostRegister(self._ptr, host.numel(), flags))
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of {host.numel()} bytes failed with CUDA error {err}")
            self.tensor = torch.as_tensor(_CudaArrayInterface(host), device=self.device)

    def close(self) -> None:
        if self._ptr is None:
            return
        torch.cuda.synchronize(self.device)
        del self.tensor
        err = int(torch.cuda.cudart().cudaHostUnregister(self._ptr))
        self._ptr = None
        if err != 0:
            raise RuntimeError(f"cudaHostUnregister failed with CUDA error {err}")

    def __enter__(self) -> CudaHostMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RowDecode(Protocol):
    """A transform of each slot's first ``src_bytes`` into a page of ``dst_bytes`` on the way in (a decoder of
    ``kvtier.kernels.dequant``; this module knows nothing of what the bytes mean)."""

    src_bytes: int
    dst_bytes: int

    def reference(self, src: torch.Tensor) -> torch.Tensor:
        """Rows ``src`` (uint8 [n, ≥ src_bytes]) transformed: uint8 [n, dst_bytes] (the CPU path)."""
        ...

    def kernel(self, src_stride: int, dst_stride: int) -> Any:
        """The GPU kernel for rows that many ``int32`` words apart, with the row copy's launch contract."""
        ...


def swap_in(
    slots: torch.Tensor, slot_ids: Any, kv_cache: torch.Tensor, page_ids: Any, decode: RowDecode | None = None
) -> None:
    """Copy block ``b`` from ``slots[slot_ids[b]]`` into page ``kv_cache[page_ids[b]]``, for every ``b``; with
    ``decode``, each page is ``decode`` of its slot's first ``decode.src_bytes`` (in the same one launch on a GPU).

    ``slots``: the CPU view of the slots for a CPU cache, their :class:`CudaHostMapping` tensor for a CUDA cache.
    Ids: 1-D integer sequences, arrays or tensors of equal length; ``page_ids`` distinct."""
    _swap(slots, slot_ids, kv_cache, page_ids, to_pages=True, decode=decode)


def swap_out(kv_cache: torch.Tensor, page_ids: Any, slots: torch.Tensor, slot_ids: Any) -> None:
    """Copy page ``kv_cache[page_ids[b]]`` into the start of ``slots[slot_ids[b]]``, for every ``b``; ``slot_ids``
    distinct. The same devices as :func:`swap_in`."""
    _swap(slots, slot_ids, kv_cache, page_ids, to_pages=False)


def _swap(
    slots: torch.Tensor,
    slot_ids: Any,
    kv_cache: torch.Tensor,
    page_ids: Any,
    to_pages: bool,
    decode: RowDecode | None = None,
) -> None:
    pages = _page_rows(kv_cache)
    if slots.dim() != 2 or slots.dtype != torch.uint8 or not slots.is_contiguous():
        raise SwapError("slots must be a contiguous uint8 tensor [slots, stride] (see slot_tensor)")
    if decode is not None and decode.dst_bytes != pages.shape[1]:
        raise SwapError(f"the decoder makes {decode.dst_bytes}-byte pages, the cache's are {pages.shape[1]} bytes")
    block = pages.shape[1] if decode is None else decode.src_bytes
    if block > slots.shape[1]:
        raise SwapError(f"a block is {block} bytes, more than a slot's {slots.shape[1]}")
    if slots.device != kv_cache.device:
        hint = " (map the slots with CudaHostMapping)" if kv_cache.device.type == "cuda" else ""
        raise SwapError(f"slots are on {slots.device}, the KV cache on {kv_cache.device}{hint}")
    s, p = _ids(slot_ids, "slot"), _ids(page_ids, "page")
    if s.size != p.size:
        raise SwapError(f"{s.size} slot ids but {p.size} page ids")
    if s.size == 0:
        return
    if kv_cache.device.type == "cpu":
        _check_ids(s, slots.shape[0], "slot", distinct=not to_pages)
        _check_ids(p, pages.shape[0], "page", distinct=to_pages)
        if decode is None:
            _host_copy(slots, s, pages, p, to_pages)
        else:
            pages.index_copy_(0, torch.from_numpy(p).long(), decode.reference(slots[torch.from_numpy(s).long()]))
    else:
        _device_copy(slots, s, pages, p, to_pages, decode)


def _page_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The KV cache as ``uint8 [num_pages, page_bytes]`` (a view)."""
    if kv_cache.dim() < 1 or kv_cache.shape[0] == 0 or kv_cache.numel() == 0:
        raise SwapError(f"the KV cache must be [num_pages, ...] with at least one non-empty page, not {kv_cache.shape}")
    if not kv_cache.is_contiguous():
        raise SwapError("the KV cache tensor must be contiguous (pages back to back)")
    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)


def _ids(ids: Any, what: str) -> np.ndarray:
    """``ids`` as a contiguous ``int64`` or ``int32`` array (no copy when it already is one); other integer types
    become ``int64``. SwapError if not 1-D integers."""
    arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise SwapError(f"{what} ids must be a 1-D sequence of integers, not {arr.dtype} of shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=arr.dtype if arr.dtype in (np.int32, np.int64) else np.int64)


def _check_ids(ids: np.ndarray, count: int, what: str, distinct: bool) -> None:
    """SwapError unless every id is in ``[0, count)`` (and, with ``distinct``, none repeats)."""
    arr = ids.astype(np.int64, copy=False)
    bad = _hostcopy.check_rows(arr, count, distinct)
    if bad >= 0 and not 0 <= arr[bad] < count:
        raise SwapError(f"{what} id {arr[bad]} out of range: there are {count} {what}s")
    if bad >= 0:
        raise SwapError(f"{what} id {arr[bad]} repeats: two blocks would be copied into one {what}")


def _host_copy(slots: torch.Tensor, s: np.ndarray, pages: torch.Tensor, p: np.ndarray, to_pages: bool) -> None:
    slot_side = (slots.data_ptr(), slots.shape[1], s.astype(np.int64, copy=False))
    page_side = (pages.data_ptr(), pages.shape[1], p.astype(np.int64, copy=False))
    dst, src = (page_side, slot_side) if to_pages else (slot_side, page_side)
    _hostcopy.copy_rows(*dst, *src, pages.shape[1])


def _device_copy(
    slots: torch.Tensor, s: np.ndarray, pages: torch.Tensor, p: np.ndarray, to_pages: bool, decode: RowDecode | None
) -> None:
    nbytes = pages.shape[1]
    if nbytes % WORD_BYTES or slots.shape[1] % WORD_BYTES or slots.data_ptr() % WORD_BYTES:
        raise SwapError(f"on a GPU, page size ({nbytes}) and slot stride ({slots.shape[1]}) must be multiples of 4")
    if max(slots.shape[0], pages.shape[0]) > STAMP_LIMIT:
        raise SwapError(f"on a GPU, at most {STAMP_LIMIT} slots and pages (ids are int32 there)")
    slot_words, page_words = slots.view(torch.int32), pages.view(torch.int32)
    src, dst = (slot_words, page_words) if to_pages else (page_words, slot_words)
    if decode is None:
        kernel = RowCopyKernel(nbytes // WORD_BYTES, src.shape[1], dst.shape[1])
    else:
        kernel = decode.kernel(src.shape[1], dst.shape[1])
    launcher = _launcher(pages.device)
    with launcher.lock:
        ok = launcher.copy(kernel, src, (s, p) if to_pages else (p, s), dst)
    if not ok:  # nothing was copied; name the first bad id as the CPU path does
        _check_ids(s, slots.shape[0], "slot", distinct=not to_pages)
        _check_ids(p, pages.shape[0], "page", distinct=to_pages)
        raise RuntimeError("swap: the device refused ids that the host check accepts")


class _Launcher:
    """One device's GPU swaps. The host writes the ids, as ``int32``, into a reused buffer of host memory mapped into
    the device; ``RowCheckKernel``, on a side stream, reads them from there (no upload call), writes them to a device
    buffer for the copy and, if they are bad, sets the call's flag word and the verdict word in front of the ids. The
    copy, queued on the caller's stream behind that check, moves nothing if the flag holds the call's stamp. The host
    waits for the check (not for the copy, nor for earlier work on the caller's stream): then the buffer is free
    again and the verdict known. One call at a time (``lock``).

    Flag words are never cleared: a call uses the word ``stamp % FLAG_WORDS`` and the check writes its stamp there
    only if the ids are bad. Each word has its own device buffer for the checked ids (kept, and grown when a call
    has more ids), written by the check and read by the copy: before a word and its buffer are used again, the copy
    that last read them must have run (an event per word, normally long past). Every tensor handed to a kernel
    starts on a 64-byte boundary (``ALIGN`` words).

    Per call the host makes no allocation and no view for calls of the size of the previous one, and switches
    streams with torch's raw stream calls instead of its stream context (which builds a ``Stream`` each time)."""

    FLAG_WORDS = 64
    ALIGN = 16  # int32 words: the ids start this far into the mapped buffer; flag words lie this far apart

    def __init__(self, device: torch.device) -> None:
        self.lock = threading.Lock()
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.checked = torch.cuda.Event()  # recorded on the side stream once the check is queued
        self.check = RowCheckKernel()
        self.flags = torch.zeros(self.FLAG_WORDS * self.ALIGN, dtype=torch.int32, device=device)
        self.flag_words = [self.flags[i : i + 1] for i in range(0, self.flags.numel(), self.ALIGN)]
        self.copied = [torch.cuda.Event() for _ in range(self.FLAG_WORDS)]  # each word's last copy, once queued
        self.row_buffers = [torch.zeros(0, dtype=torch.int32, device=device)] * self.FLAG_WORDS  # each word's
        self.rows = [buffer.view(2, 0) for buffer in self.row_buffers]  # their views for the word's last call
        self.streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}  # callers' streams by torch's stream key
        # [verdict, padding, ids...] as int32 in host memory mapped into the device (the device's view: ``mapped``)
        self.mapping: CudaHostMapping | None = None
        self.host = np.zeros(0, dtype=np.int32)
        self.mapped = torch.zeros(0, dtype=torch.int32)
        self.verdict = self.mapped
        self.ids = self.mapped.view(2, 0)  # the mapped ids of the last call's size, [2, n]
        self.claims = torch.zeros(0, dtype=torch.int32, device=device)
        self.stamp = 0

    def copy(self, kernel: Any, src: torch.Tensor, ids: tuple[np.ndarray, np.ndarray], dst: torch.Tensor) -> bool:
        """Copy ``src[ids[0][b]]`` to ``dst[ids[1][b]]`` on the current stream, all or nothing; False if the ids
        were refused (then nothing is or will be copied)."""
        n, at = ids[0].size, self.ALIGN
        self._reserve(at + 2 * n)
        host = self.host
        host[0] = 0
        if _hostcopy.narrow_ids(host, at, ids[0]) >= 0 or _hostcopy.narrow_ids(host, at + n, ids[1]) >= 0:
            return False  # an id beyond int32 is beyond every table here: refused before any launch
        stamp = self._next_stamp(dst.shape[0])
        word = stamp % self.FLAG_WORDS
        self.copied[word].synchronize()  # the copy that last used this flag word and row buffer has read them
        flag, rows, checked = self.flag_words[word], self._rows(word, n), self._mapped_ids(n)
        index, side = self.device.index, self.side
        device_was, caller_key = torch._C._cuda_getDevice(), torch._C._cuda_getCurrentStream(index)
        caller = self._stream(caller_key)
        try:  # torch's raw stream calls (its stream context makes Stream objects): these also make `index` current
            torch._C._cuda_setStream(stream_id=side.stream_id, device_index=index, device_type=side.device_type)
            try:
                self.check(checked, rows, self.verdict, flag, self.claims, src.shape[0], dst.shape[0], stamp)
                self.checked.record(side)
            finally:
                torch._C._cuda_setStream(stream_id=caller_key[0], device_index=index, device_type=caller_key[2])
            caller.wait_event(self.checked)
            kernel(src, rows, dst, flag, stamp)
            self.copied[word].record(caller)
        finally:
            if device_was != index:
                torch._C._cuda_setDevice(device_was)
            self.checked.synchronize()  # the check has read the ids (the copy runs on); the buffer is free again
        return host[0] == 0

    def _stream(self, key: tuple[int, int, int]) -> torch.cuda.Stream:
        """The ``Stream`` for torch's stream key, made once (``torch.cuda.current_stream`` builds a new one)."""
        stream = self.streams.get(key)
        if stream is None:
            if len(self.streams) >= 256:  # external streams come and go: keep the table small
                self.streams.clear()
            stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self.streams[key] = stream
        return stream

    def _rows(self, word: int, n: int) -> torch.Tensor:
        """Word ``word``'s device buffer for ``n`` checked ids, ``[2, n]`` (its view kept while calls keep the size;
        a buffer too small replaced only here, once the copy that read it has run)."""
        rows = self.rows[word]
        if rows.shape[1] != n:
            if self.row_buffers[word].numel() < 2 * n:
                self.row_buffers[word] = torch.empty(2 * n, dtype=torch.int32, device=self.device)
            rows = self.rows[word] = self.row_buffers[word][: 2 * n].view(2, n)
        return rows

    def _mapped_ids(self, n: int) -> torch.Tensor:
        """The device's view of the ids' place in the mapped buffer, ``[2, n]`` (kept while calls keep the size)."""
        if self.ids.shape[1] != n:
            self.ids = self.mapped[self.ALIGN : self.ALIGN + 2 * n].view(2, n)
        return self.ids

    def _reserve(self, words: int) -> None:
        """A mapped buffer of at least ``words`` ``int32`` words (its own pages: CUDA refuses to register a page
        twice)."""
        if self.host.size >= words:
            return
        if self.mapping is not None:
            self.mapping.close()
        memory = mmap.mmap(-1, 4 * max(words, 2 * self.host.size, 8192))
        self.host = np.frombuffer(memory, dtype=np.int32)
        self.mapping = CudaHostMapping(torch.from_numpy(self.host).view(torch.uint8), self.device)
        self.mapped = self.mapping.tensor.view(torch.int32)
        self.verdict = self.mapped[:1]
        self.ids = self.mapped[self.ALIGN : self.ALIGN].view(2, 0)

    def _next_stamp(self, dst_count: int) -> int:
        """A stamp above every earlier one, with claims for ``dst_count`` rows."""
        if self.claims.numel() < dst_count:
            with torch.cuda.stream(self.side):
                self.claims = torch.zeros(dst_count, dtype=torch.int32, device=self.device)
        if self.stamp == STAMP_LIMIT:  # once in 2**31 calls: start again, with no copy left to read a flag
            torch.cuda.synchronize(self.device)
            self.claims.zero_()
            self.flags.zero_()
            torch.cuda.synchronize(self.device)
            self.stamp = 0
        self.stamp += 1
        return self.stamp


_launchers: dict[torch.device, _Launcher] = {}
_launchers_lock = threading.Lock()


def _launcher(device: torch.device) -> _Launcher:
    with _launchers_lock:
        if device not in _launchers:
            _launchers[device] = _Launcher(device)
        return _launchers[device]
