"""The decoding gather: ``dst[dst_rows[b]] = decode(src[src_rows[b]])`` for every ``b`` in one launch, a layout of
``kvquant`` segments decoded on the way (swap-in of low-precision blocks: only the encoded bytes cross PCIe).

``DecodeRows`` is what ``transfer.swapin.swap_in`` takes as ``decode``: the encoded and decoded row sizes, the torch
definition (:meth:`DecodeRows.reference`, ``kvquant.decode_rows`` row by row) and the TileLang kernel
(:meth:`DecodeRows.kernel`) with the row copy's launch contract (``kernels/rowcopy.py``): ``kernel(src, rows, dst,
flag, stamp)``, ``src`` and ``dst`` as ``int32`` words, ``rows`` ``int32 [2, n]``, nothing moved if ``flag[0] ==
stamp``.

The kernel: a CTA per (block, tile), a tile being up to ``TILE`` chunks of 16 encoded bytes of one segment (a table
on the device, made once per layout, says each tile's segment, codec and offsets). The CTA first copies its chunks
(one 16-byte load a thread a chunk, as the row copy reads) and the scale bytes they need into shared memory: those are
the only reads of the source, so each crosses PCIe once, in long runs. Then each thread makes 4-byte output words (two
bfloat16 or one float32 value) from shared memory and writes them where their row puts them. Values are made from
bits with integer operations (the float32 bits of the element, the scale's exponent added, the ``kvquant`` rules at
the range ends) except ``fp8-e4m3``'s product of two E4M3 values, which is exact in float32: the output equals the
reference bit for bit whatever the compiler's flush-to-zero setting. Compiled for ``target="c"`` it runs on CPU
tensors (tests check it there; the GPU's code is the same but for vector widths).

No ``from __future__ import annotations`` here: TileLang evaluates the kernels' annotations.
"""

import functools
from typing import Any

import torch

from kvtier.kernels.kvquant import CODECS, OUT_DTYPES, Segment, decode_rows, encoded_bytes

TILE = 512  # chunks of 16 encoded bytes a CTA decodes (8 KiB)
THREADS = 256
CHUNK_BYTES = 16
# what the kernel does with a segment
COPY, WIDEN, E4M3_E4M3, MX_E4M3, MX_E2M1 = range(5)
FIELDS = 9  # per tile: kind, values, width, element 16-byte unit, scale word, destination word, row words, chunk, count


def _kind(segment: Segment, out_itemsize: int) -> int:
    codec = CODECS[segment.codec]
    if codec.element == "raw":
        return COPY
    if codec.element == "bf16":
        return COPY if out_itemsize == 2 else WIDEN
    if codec.scale == "e4m3":
        return E4M3_E4M3
    return MX_E4M3 if codec.element == "e4m3" else MX_E2M1


def _values_per_chunk(kind: int, out_itemsize: int) -> int:
    return {COPY: CHUNK_BYTES // out_itemsize, WIDEN: 8, E4M3_E4M3: 16, MX_E4M3: 16, MX_E2M1: 32}[kind]


class DecodeRows:
    """Decoding of one layout (``segments``, values in ``dtype``: bfloat16 or float32) from rows of ``src_bytes``
    encoded bytes into rows of ``dst_bytes``. Every byte of a decoded row must belong to a segment."""

    def __init__(self, segments: tuple[Segment, ...], dtype: torch.dtype) -> None:
        if dtype not in OUT_DTYPES:
            raise ValueError(f"decoding gathers make bfloat16 or float32 rows, not {dtype}")
        for s in segments:
            CODECS[s.codec].check(s.width, f"segment {s}")
        self.segments, self.dtype = segments, dtype
        self.src_bytes = encoded_bytes(segments)
        self.dst_bytes = max(s.dst_offset + (s.rows - 1) * s.dst_row_stride + s.width * s.itemsize for s in segments)
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._kernels: dict[tuple[int, int, str], DecodeKernel] = {}

    def reference(self, src: torch.Tensor) -> torch.Tensor:
        """The definition: rows ``src`` (uint8 [n, ≥ src_bytes]) decoded, uint8 [n, dst_bytes]."""
        return decode_rows(src[:, : self.src_bytes], self.segments, self.dtype)

    def table(self) -> list[list[int]]:
        """The kernel's tiles (``FIELDS`` ints each). Raises ValueError for a layout the kernel cannot take (values
        other than bfloat16 / float32, rows not in whole 4-byte words)."""
        out_itemsize = torch.empty(0, dtype=self.dtype).element_size()
        tiles = []
        for s in self.segments:
            kind = _kind(s, out_itemsize)
            if s.itemsize != out_itemsize or (s.width * s.itemsize) % 4 or s.dst_offset % 4 or s.dst_row_stride % 4:
                raise ValueError(f"the decoding kernel needs {self.dtype} rows in whole words, not {s}")
            chunks = -(-s.element_bytes // CHUNK_BYTES)
            scale_word = (s.src_offset + s.element_bytes) // 4
            for first in range(0, chunks, TILE):
                tiles.append(
                    [
                        kind,
                        s.rows * s.width,
                        s.width,
                        s.src_offset // CHUNK_BYTES,
                        scale_word,
                        s.dst_offset // 4,
                        s.dst_row_stride // 4,
                        first,
                        min(TILE, chunks - first),
                    ]
                )
        return tiles

    def kernel(self, src_stride: int, dst_stride: int, target: str = "cuda") -> "DecodeKernel":
        """The TileLang kernel for source rows ``src_stride`` words apart and destination rows ``dst_stride`` apart
        (built once per strides and target)."""
        key = (src_stride, dst_stride, target)
        if key not in self._kernels:
            self._kernels[key] = DecodeKernel(self, src_stride, dst_stride, target)
        return self._kernels[key]

    def device_table(self, device: torch.device) -> torch.Tensor:
        """The tile table on ``device`` (made once)."""
        held = self._tables.get(device)
        if held is None:
            held = self._tables[device] = torch.tensor(self.table(), dtype=torch.int32, device=device)
        return held


class DecodeKernel:
    """One compiled decoding gather (cached per layout kinds and strides for the process)."""

    def __init__(self, rows: DecodeRows, src_stride: int, dst_stride: int, target: str = "cuda") -> None:
        if src_stride % 4 or rows.src_bytes > 4 * src_stride or rows.dst_bytes > 4 * dst_stride:
            raise ValueError(f"rows of {rows.src_bytes} / {rows.dst_bytes} bytes do not fit strides of {src_stride} / "
                             f"{dst_stride} words (the source's a multiple of 4)")  # fmt: skip
        self.rows = rows
        out_itemsize = torch.empty(0, dtype=rows.dtype).element_size()
        kinds = tuple(sorted({t[0] for t in rows.table()}))
        self._kernel = _decode(kinds, out_itemsize, src_stride, dst_stride, target)

    def __call__(
        self, src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor, stamp: int
    ) -> None:
        """Launch on the current stream (returns without waiting); decodes nothing if ``flag[0] == stamp``."""
        self._kernel(src, rows, flag, dst, self.rows.device_table(src.device), stamp)


# --- the values, from bits ----------------------------------------------------------------------------------------

# The values' bit arithmetic, as C the kernel inlines (CUDA and the C target alike): float32 bits of each code made
# with integer operations, a UE8M0 scale's exponent added to them (zero below the normal range, infinity past it, the
# canonical NaN for NaN), an E4M3 scale multiplied in float32 (exact: both have 4 significant bits). ``kvq_word``
# makes one output word: two bfloat16 (the upper halves of two values' float32 bits; the values are exact in
# bfloat16) or one float32, from ``many`` codes that start at bit ``shift`` of ``word``; ``kind`` is a constant at
# each call, so each call compiles to its kind's code only; ``kvq_at`` says where that word goes.
VALUES_C = (
    f"#define KVQ_MX_E2M1 {MX_E2M1}\n#define KVQ_MX_E4M3 {MX_E4M3}\n"
    + """
#ifdef __CUDACC__
#define KVQ_FN __device__ __forceinline__
#define KVQ_API KVQ_FN
KVQ_FN float kvq_float(int bits) { return __int_as_float(bits); }
KVQ_FN int kvq_bits(float value) { return __float_as_int(value); }
#else
#include <string.h>
#define KVQ_FN static inline
#define KVQ_API extern "C" inline  /* the C target declares what the kernel calls with C linkage */
KVQ_FN float kvq_float(int bits) { float f; memcpy(&f, &bits, 4); return f; }
KVQ_FN int kvq_bits(float value) { int b; memcpy(&b, &value, 4); return b; }
#endif
#define KVQ_NAN 0x7FC00000
KVQ_FN int kvq_e4m3(int x) {
  int sign = (x & 0x80) << 24, e = (x >> 3) & 15, m = x & 7;
  if (e) return sign | ((e + 120) << 23) | (m << 20);
  if (!m) return sign;
  int lead = m >= 4 ? 2 : (m >= 2 ? 1 : 0);
  return sign | ((lead + 118) << 23) | (((m << (3 - lead)) & 7) << 20);
}
KVQ_FN int kvq_e2m1(int x) {
  int e = (x >> 1) & 3, m = x & 1, sign = (x & 8) << 28;
  if (e) return sign | ((e + 126) << 23) | (m << 22);
  return sign | (m ? 126 << 23 : 0);
}
KVQ_FN int kvq_scaled(int bits, int k) {
  int exponent = ((bits >> 23) & 0xFF) + k - 127;
  exponent = exponent < 0 ? 0 : (exponent > 255 ? 255 : exponent);
  if ((bits & 0x7FFFFFFF) == 0) exponent = 0;
  int mantissa = (exponent > 0 && exponent < 255) ? (bits & 0x7FFFFF) : 0;
  return (bits & (int)0x80000000) | (exponent << 23) | mantissa;
}
KVQ_FN int kvq_value(int kind, int x, int k) {
  if (kind == KVQ_MX_E2M1) return k == 255 ? KVQ_NAN : kvq_scaled(kvq_e2m1(x), k);
  if ((x & 0x7F) == 0x7F) return KVQ_NAN;
  if (kind == KVQ_MX_E4M3) return k == 255 ? KVQ_NAN : kvq_scaled(kvq_e4m3(x), k);
  if ((k & 0x7F) == 0x7F) return KVQ_NAN;
  return kvq_bits(kvq_float(kvq_e4m3(x)) * kvq_float(kvq_e4m3(k)));
}
/* the output word of a segment's value e (rows of width values, row_words apart from word out_word), in int32:
   written in TIR, the index is widened to int64 before its division (several times an int32 division's cost) */
KVQ_API int kvq_at(int e, int width, int out_word, int row_words, int itemsize) {
  int row = e / width;
  return out_word + row * row_words + (e - row * width) * itemsize / 4;
}
KVQ_API int kvq_word(int kind, int word, int shift, int k, int many) {
  int bits = kind == KVQ_MX_E2M1 ? 4 : 8, mask = (1 << bits) - 1;
  int low = kvq_value(kind, (word >> shift) & mask, k);
  if (many == 1) return low;
  int high = kvq_value(kind, (word >> (shift + bits)) & mask, k);
  return ((low >> 16) & 0xFFFF) | (high & (int)0xFFFF0000);
}
"""
)


@functools.cache
def _decode(kinds: tuple[int, ...], out_itemsize: int, src_stride: int, dst_stride: int, target: str) -> Any:
    import tilelang
    import tilelang.language as T

    from kvtier.kernels.rowcopy import _entry

    n = T.dynamic("n")
    tiles = T.dynamic("tiles")
    src_count = T.dynamic("src_count")
    dst_count = T.dynamic("dst_count")
    scale_words = TILE // 4  # at most one scale byte a chunk
    per_word = 4 // out_itemsize  # values in a 4-byte output word
    SCALES = TILE * 4  # where the tile's scale words start in ``buf``

    def output(buf: Any, kind: int, v: Any) -> Any:
        """The output word of the tile's values ``v …`` from the shared buffer."""
        if kind == WIDEN:
            return (buf[v >> 1] >> ((v & 1) << 4)) << 16
        g = v // (16 if kind == E4M3_E4M3 else 32)
        k = (buf[SCALES + (g >> 2)] >> ((g & 3) << 3)) & 0xFF
        per = 8 if kind == MX_E2M1 else 4  # codes a word
        shift = (v % per) * (32 // per)
        return T.call_extern("int32", "kvq_word", kind, buf[v // per], shift, k, per_word)

    @T.prim_func
    def decode_rows(
        src: T.Tensor((src_count, src_stride), "int32"),
        rows: T.Tensor((2, n), "int32"),
        flag: T.Tensor((1,), "int32"),
        dst: T.Tensor((dst_count, dst_stride), "int32"),
        table: T.Tensor((tiles, FIELDS), "int32"),
        stamp: T.int32,
    ):
        with T.Kernel(n, tiles, threads=THREADS) as (b, t):
            T.import_source(VALUES_C)
            # one buffer (the C target takes one): the tile's chunks, then the tile's scale bytes
            buf = T.alloc_shared((TILE * 4 + scale_words,), "int32")
            if flag[0] != stamp:
                s = T.cast(rows[0, b], "int64")
                d = T.cast(rows[1, b], "int64")
                kind, total, width = table[t, 0], table[t, 1], table[t, 2]
                unit, scale_word, out_word, row_words = table[t, 3], table[t, 4], table[t, 5], table[t, 6]
                first, count = table[t, 7], table[t, 8]
                for j, q in T.Parallel(TILE, 4):
                    if j < count:
                        buf[j * 4 + q] = src[s, (unit + first + j) * 4 + q]
                for here in kinds:  # a Python loop: one branch of code per kind the layout has
                    if kind == here:
                        per_chunk = _values_per_chunk(here, out_itemsize)
                        group = 16 if here == E4M3_E4M3 else 32
                        if here >= E4M3_E4M3:
                            for w in T.Parallel(scale_words):
                                if w * 4 * group < count * per_chunk:
                                    buf[SCALES + w] = src[s, scale_word + first * per_chunk // (4 * group) + w]
                        for o in T.Parallel(TILE * per_chunk // per_word):
                            v = o * per_word  # the tile's value
                            e = T.bind(first * per_chunk + v)  # the segment's value
                            if v < count * per_chunk and e < total:
                                at = T.call_extern("int32", "kvq_at", e, width, out_word, row_words, out_itemsize)
                                dst[d, at] = buf[o] if here == COPY else output(buf, here, v)

    return _entry(tilelang.compile(decode_rows, target=target))
