"""Low-precision KV element formats ("codecs") and block layouts made of them: the torch definitions every kernel is
tested against bit for bit.

A codec turns a row of ``width`` values into bytes and back. One table says each (OCP Microscaling v1.0 style):

| codec | element | group | scale | bytes per group | decoded value |
|---|---|---|---|---|---|
| ``exact`` | the compute dtype, as is | – | – | – | the bytes |
| ``bf16`` | bfloat16 (round to nearest even) | – | – | 2 per element | the element |
| ``fp8-e4m3`` | E4M3 | 16 | E4M3, positive | 16 + 1 | element × scale |
| ``mxfp8`` | E4M3 | 32 | UE8M0 (``2**(k−127)``) | 32 + 1 | element × scale |
| ``mxfp4`` | E2M1 | 32 | UE8M0 | 16 + 1 | element × scale |

E4M3 is OCP's FP8 E4M3 (torch ``float8_e4m3fn``): bias 7, no infinity, ``S.1111.111`` NaN, largest 448, subnormals
``m × 2**-9``. E2M1 is OCP's FP4: bias 1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, no NaN or infinity;
two a byte, the first in the low nibble. UE8M0 is an exponent: ``k`` in 0…254 is ``2**(k−127)``, 255 is NaN.

``fp8-e4m3`` is the seed's per-16 format of the main KV, "like NVFP4 without the global scale": NVFP4's group (16)
and scale type (E4M3) with E4M3 elements instead of E2M1. NVFP4 needs its second, per-tensor FP32 scale because E2M1
spans 3.6 binades and an E4M3 scale only ~17.8: the global scale moves the tensor into the scale's reach. E4M3
elements span 17.8 binades themselves, so a group whose largest value is too small for the scale (below
``448 × 2**-9 = 0.875``) keeps the element's full precision down to ``2**-15`` absolute, and one too large (above
``448 × 448``) saturates: no global scale is needed for KV, whose values sit far inside that range. An E4M3 scale,
rather than a power of two, maps each group's largest value to within 1/8 of 448 (a UE8M0 scale only within a
factor 2), and the product of two E4M3 values has at most 8 significant bits: every decoded value is a bfloat16
(and float32) exactly, so decoding rounds nothing.

**Encoding** (``encode``, the same torch code on any device):

- ``fp8-e4m3``: the group's largest magnitude ``a``; scale = ``a / 448`` rounded to E4M3 (nearest even), then one
  step up if ``448 × scale < a``, kept in ``[2**-9, 448]``; elements = ``x / scale`` clamped to ±448, rounded to E4M3
  (nearest even).
- ``mxfp8`` / ``mxfp4``: the smallest ``k`` in ``[0, 254]`` with ``a ≤ top × 2**(k−127)`` (``top`` the element's
  largest value, 448 or 6; ``a = 0``: 0), elements = ``x × 2**(127−k)`` clamped to ±``top``, rounded to nearest even.
  OCP's example conversion takes ``k = floor(log2(a)) − emax + 127`` instead, which clamps a group's largest values
  (by up to 1/8 in E4M3, 1/4 in E2M1); rounding the scale up clamps nothing (Gaussian rows: MXFP8 RMS error 2.66 %
  against 2.93 %, worst value 5.9 % against 12.5 % of the group's largest; MXFP4 11.6 % / 20 % against 11.5 % /
  25 %). The bytes are MX either way: decoding is the spec's.
- ±Inf saturates to ± the largest value; a group holding a NaN encodes as NaN (its scale byte NaN: E4M3 ``0x7F``,
  UE8M0 ``0xFF``). Nothing is refused: a NaN decodes as NaN, never as a number.

**Decoding** (``decode``): ``element × scale`` exactly; NaN if either is NaN (the canonical quiet NaN: float32
``0x7FC00000``, bfloat16 ``0x7FC0``); a magnitude below ``2**-126`` (the smallest normal float32; only UE8M0 scales
below ``2**-117`` reach it) becomes a zero of the product's sign, one of ``2**128`` or more infinity of its sign;
then the value, exact in float32 and bfloat16, in the output dtype (``bfloat16`` or ``float32``: its bits are the
float32 bits' upper half).

A **layout** is a block's (or StateBlock's) encoded form: :class:`Segment` s, each ``rows × width`` values of the
decoded bytes (a row every ``dst_row_stride`` bytes) in one codec. Encoded, a segment is its elements (row-major),
then its scale bytes (row-major), zero-padded to a multiple of ``ALIGN`` bytes; segments follow one another.
:func:`encode_rows` and :func:`decode_rows` apply a layout to many blocks at once. Nothing here imports kvtier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16  # bytes: every segment of an encoded block starts on this boundary (one 16-byte load on a GPU)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0…7; 8…15 are their negatives
# |x| at which E2M1 rounding moves up a code (ties go to the even code)
_E2M1_STEPS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_SIGN = -(2**31)  # float32's sign bit, as an int32
_NAN_BITS = 0x7FC00000  # the canonical quiet NaN
OUT_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Codec:
    """One element format (see the module docstring's table)."""

    name: str
    element: str  # "e4m3", "e2m1", "bf16" or "raw" (the compute dtype's bytes)
    group: int = 0  # values per scale (0: no scale)
    scale: str = ""  # "e4m3" or "ue8m0"

    @property
    def bits(self) -> int:
        return {"e4m3": 8, "e2m1": 4, "bf16": 16}.get(self.element, 0)

    def row_bytes(self, width: int, itemsize: int) -> int:
        """Bytes of one encoded row of ``width`` values (``itemsize``: the decoded dtype's, for ``raw``)."""
        elements = width * itemsize if self.element == "raw" else width * self.bits // 8
        return elements + (width // self.group if self.group else 0)

    def check(self, width: int, where: str) -> None:
        """ValueError (one line) unless rows of ``width`` values can take this codec."""
        if self.group and width % self.group:
            raise ValueError(f"{where}: {self.name} needs rows of a multiple of {self.group} values, not {width}")


CODECS = {
    c.name: c
    for c in (
        Codec("exact", "raw"),
        Codec("bf16", "bf16"),
        Codec("fp8-e4m3", "e4m3", 16, "e4m3"),
        Codec("mxfp8", "e4m3", 32, "ue8m0"),
        Codec("mxfp4", "e2m1", 32, "ue8m0"),
    )
}


# --- elements and scales -------------------------------------------------------------------------------------------


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """``y`` (already within ±6) rounded to E2M1, nearest even: codes 0…15 (uint8), sign in bit 3."""
    steps = torch.tensor(_E2M1_STEPS, dtype=torch.float32, device=y.device)
    a = y.abs().contiguous()
    down, up = torch.bucketize(a, steps, right=False), torch.bucketize(a, steps, right=True)  # differ only at ties
    code = torch.where(up % 2 == 0, up, down).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """``y`` rounded to E4M3 (nearest even), saturating at ±448 (torch's cast makes NaN of anything past 464)."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as float32 values (exact; NaN for ``0x7F`` / ``0xFF``)."""
    return codes.view(torch.float8_e4m3fn).float()


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    table[8] = -0.0
    return table[codes.long()]


def _ue8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 codes as float64 values, made from their bits (exact on any device; NaN for 255)."""
    values = ((codes.long() - 127 + 1023) << 52).view(torch.float64)
    return torch.where(codes == 255, torch.nan, values)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2**exponent`` as float32 for integer exponents in ``[-127, 127]``, made from its bits (exact anywhere)."""
    e = exponent.to(torch.int32)
    return torch.where(e >= -126, (e + 127) << 23, 1 << 22).view(torch.float32)


def encode(codec: Codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [..., width] (bfloat16 or float32 values) as ``(elements, scales)``, uint8 [..., element bytes] and
    [..., width / group] (scales empty without a group). ``raw`` and ``bf16`` only convert."""
    if codec.element == "raw":
        return x.contiguous().view(torch.uint8), x.new_zeros(0, dtype=torch.uint8)
    if codec.element == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.uint8), x.new_zeros(0, dtype=torch.uint8)
    groups = x.float().unflatten(-1, (-1, codec.group))
    amax = groups.abs().amax(-1)  # NaN if the group holds one
    nan = torch.isnan(amax)
    if codec.scale == "e4m3":
        code = (amax / E4M3_MAX).clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        value = code.view(torch.float8_e4m3fn).float()
        code = code + ((value * E4M3_MAX < amax) & (value < E4M3_MAX)).to(torch.uint8)  # codes ascend with value
        scale = code.view(torch.float8_e4m3fn).float()
        y = groups / scale[..., None]
        scales = torch.where(nan, 0x7F, code)
    else:
        top = E4M3_MAX if codec.element == "e4m3" else E2M1_MAX
        emax = 8 if codec.element == "e4m3" else 2  # top = 1.75 or 1.5 × 2**emax
        k = (torch.frexp(amax).exponent - 1 - emax + 127).clamp(0, 254)  # floor(log2(a)) − emax + 127
        k = (k + (amax.double() > top * _ue8m0_values(k.to(torch.uint8))).to(k.dtype)).clamp(max=254)  # a ≤ top × X
        k = torch.where(amax == 0, 0, torch.where(torch.isinf(amax), 254, k))
        y = groups * _power_of_two(127 - k)[..., None]
        y = torch.where(torch.isinf(groups), groups, y)  # (an Inf's group has 2**-127 as multiplier)
        scales = torch.where(nan, 255, k).to(torch.uint8)
    if codec.element == "e4m3":
        elements = _e4m3_codes(y).flatten(-2)
    else:
        codes = _e2m1_codes(y.clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)
        elements = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return elements, scales


def decode(codec: Codec, elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., width] in ``dtype`` (bfloat16 or float32) from :func:`encode`'s bytes.

    The rules of the module docstring, computed on float32 bits: an element's bits with the UE8M0 scale's exponent
    added (clamped: zero below the normal range, infinity past it), or the float32 product of two E4M3 values (exact),
    then the canonical NaN where either was NaN (torch's casts and products vary NaN payloads)."""
    if codec.element == "raw":
        return elements.contiguous().view(dtype)
    if codec.element == "bf16":
        return elements.contiguous().view(torch.bfloat16).to(dtype)
    if codec.element == "e4m3":
        values = _e4m3_values(elements)
    else:
        low, high = elements & 0xF, elements >> 4
        values = _e2m1_values(torch.stack((low, high), dim=-1).flatten(-2))
    values = values.unflatten(-1, (-1, codec.group))
    nan = torch.isnan(values)
    if codec.scale == "e4m3":
        scale = _e4m3_values(scales)[..., None]
        bits = (values * scale).view(torch.int32)  # both 4 significant bits: exact, and never below 2**-18
        nan = nan | torch.isnan(scale)
    else:
        bits = values.view(torch.int32)
        k = scales.to(torch.int32)[..., None]
        exponent = (((bits >> 23) & 0xFF) + k - 127).clamp(0, 255)
        exponent = torch.where(bits & 0x7FFFFFFF == 0, 0, exponent)
        mantissa = torch.where((exponent > 0) & (exponent < 255), bits & 0x7FFFFF, 0)
        bits = (bits & _SIGN) | (exponent << 23) | mantissa
        nan = nan | (k == 255)
    bits = torch.where(nan, _NAN_BITS, bits).flatten(-2)
    return bits.view(torch.float32) if dtype == torch.float32 else (bits >> 16).to(torch.int16).view(torch.bfloat16)


# --- layouts -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """``rows × width`` values of a decoded block in one codec: row ``r`` starts ``dst_offset + r × dst_row_stride``
    bytes into the decoded block; encoded, the segment starts ``src_offset`` bytes into the encoded block.
    ``itemsize``: bytes of a decoded value (1 for opaque bytes, which only ``exact`` takes)."""

    codec: str
    rows: int
    width: int
    itemsize: int
    src_offset: int
    dst_offset: int
    dst_row_stride: int

    @property
    def element_bytes(self) -> int:
        return self.rows * (CODECS[self.codec].row_bytes(self.width, self.itemsize) - self.scale_bytes // self.rows)

    @property
    def scale_bytes(self) -> int:
        group = CODECS[self.codec].group
        return self.rows * self.width // group if group else 0

    @property
    def encoded_bytes(self) -> int:
        """Elements, scales and the padding to ``ALIGN``."""
        return -(-(self.element_bytes + self.scale_bytes) // ALIGN) * ALIGN


def encoded_bytes(segments: tuple[Segment, ...]) -> int:
    """Bytes of one encoded block of this layout."""
    return segments[-1].src_offset + segments[-1].encoded_bytes if segments else 0


def _decoded_view(blocks: torch.Tensor, s: Segment, dtype: torch.dtype) -> torch.Tensor:
    """Segment ``s`` of ``blocks`` (uint8 [n, decoded bytes], rows contiguous) as values [n, rows, width] (a view)."""
    row = s.width * s.itemsize
    shape, strides = (blocks.shape[0], s.rows, row), (blocks.stride(0), s.dst_row_stride, 1)
    view = blocks.as_strided(shape, strides, blocks.storage_offset() + s.dst_offset)
    return view if s.itemsize == 1 else view.view(dtype)


def encode_rows(blocks: torch.Tensor, segments: tuple[Segment, ...], dtype: torch.dtype) -> torch.Tensor:
    """Decoded blocks (uint8 [n, decoded bytes], values in ``dtype``) encoded: uint8 [n, encoded bytes], on their
    device."""
    n = blocks.shape[0]
    out = torch.zeros(n, encoded_bytes(segments), dtype=torch.uint8, device=blocks.device)
    for s in segments:
        elements, scales = encode(CODECS[s.codec], _decoded_view(blocks, s, dtype))
        at = s.src_offset
        out[:, at : at + s.element_bytes] = elements.reshape(n, -1)
        at += s.element_bytes
        out[:, at : at + s.scale_bytes] = scales.reshape(n, -1)
    return out


def decode_rows(
    encoded: torch.Tensor, segments: tuple[Segment, ...], dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Encoded blocks (uint8 [n, ≥ encoded bytes]) decoded into ``out`` (uint8 [n, decoded bytes]; made if None,
    bytes no segment covers left as they are); returns ``out``."""
    n = encoded.shape[0]
    if out is None:
        decoded = max(s.dst_offset + (s.rows - 1) * s.dst_row_stride + s.width * s.itemsize for s in segments)
        out = torch.zeros(n, decoded, dtype=torch.uint8, device=encoded.device)
    for s in segments:
        codec = CODECS[s.codec]
        elements = encoded[:, s.src_offset : s.src_offset + s.element_bytes].reshape(n, s.rows, -1)
        at = s.src_offset + s.element_bytes
        scales = encoded[:, at : at + s.scale_bytes].reshape(n, s.rows, -1)
        values = decode(codec, elements, scales, dtype if s.itemsize > 1 else torch.uint8)
        _decoded_view(out, s, dtype).copy_(values)
    return out


def layout_key(segments: tuple[Segment, ...]) -> str:
    """A stable text naming the layout's every field (what a namespace needs to tell layouts apart)."""
    fields = ("codec", "rows", "width", "itemsize", "src_offset", "dst_offset", "dst_row_stride")
    return ";".join(",".join(str(getattr(s, f)) for f in fields) for s in segments)


def check_dtype(dtype: torch.dtype, where: str) -> None:
    if dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: low-precision KV formats decode to bfloat16 or float32, not {dtype}")
