"""The KV element formats' torch definitions (``kernels/kvquant.py``) pinned byte for byte by hand-computed vectors:
zeros, subnormal elements, ties rounding to even, the scale's range ends, saturation, Inf saturated and NaN kept as
NaN; decoding every code exactly (against float64 arithmetic); layouts of segments with their offsets and padding."""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels.kvquant import CODECS, Segment, decode, decode_rows, encode, encode_rows, encoded_bytes

E4M3, MX8, MX4 = CODECS["fp8-e4m3"], CODECS["mxfp8"], CODECS["mxfp4"]


def group(values: list[float], size: int) -> torch.Tensor:
    """One row of ``size`` values: ``values`` then zeros."""
    return torch.tensor([*values, *[0.0] * (size - len(values))], dtype=torch.float32)[None]


def bytes_of(codec, values: list[float], size: int) -> tuple[list[int], list[int]]:
    elements, scales = encode(codec, group(values, size))
    return elements[0].tolist(), scales[0].tolist()


# --- fp8-e4m3: E4M3 elements, an E4M3 scale per 16 --------------------------------------------------------------


def test_fp8_e4m3_zeros_take_the_smallest_scale() -> None:
    assert bytes_of(E4M3, [], 16) == ([0] * 16, [0x01])


def test_fp8_e4m3_group_of_448_has_scale_one_and_its_values_as_e4m3() -> None:
    elements, scales = bytes_of(E4M3, [448.0, -448.0, 1.0, 0.5, -2.0], 16)
    assert scales == [0x38]  # 1.0
    assert elements[:5] == [0x7E, 0xFE, 0x38, 0x30, 0xC0]


def test_fp8_e4m3_scale_rounds_up_so_the_largest_value_fits() -> None:
    # 1 / 448 rounds to 2**-9, and 448 * 2**-9 = 0.875 < 1: one step up to 2**-8; 1.0 is then 256
    elements, scales = bytes_of(E4M3, [1.0], 16)
    assert scales == [0x02] and elements[0] == 0x78


def test_fp8_e4m3_subnormal_elements_and_ties_to_even() -> None:
    # scale 1 (largest 448): 2**-9 is the smallest subnormal; 2**-10 ties 0 / 2**-9 (to 0); 1.5 * 2**-9 ties m=1 /
    # m=2 (to 2); 2.5 * 2**-9 ties m=2 / m=3 (to 2)
    elements, _ = bytes_of(E4M3, [448.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-9, 2.5 * 2.0**-9, -(2.0**-9)], 16)
    assert elements[1:6] == [0x01, 0x00, 0x02, 0x02, 0x81]


def test_fp8_e4m3_saturates_past_448_squared_and_at_inf() -> None:
    elements, scales = bytes_of(E4M3, [1e6, -(448.0**2), float("inf"), float("-inf")], 16)
    assert scales == [0x7E] and elements[:4] == [0x7E, 0xFE, 0x7E, 0xFE]
    assert decode(E4M3, torch.tensor([elements]), torch.tensor([scales]), torch.float32)[0, 0] == 448.0**2


def test_fp8_e4m3_a_nan_makes_its_group_nan() -> None:
    elements, scales = encode(E4M3, group([float("nan")] + [0.0] * 15 + [1.0], 32))
    assert scales[0].tolist() == [0x7F, 0x02]
    out = decode(E4M3, elements, scales, torch.float32)[0]
    assert out[:16].isnan().all() and out[16] == 1.0 and out[17:].eq(0).all()


# --- mxfp8: E4M3 elements, a UE8M0 scale per 32 -----------------------------------------------------------------


def test_mxfp8_zeros_and_a_group_of_448() -> None:
    assert bytes_of(MX8, [], 32) == ([0] * 32, [0])
    elements, scales = bytes_of(MX8, [448.0, -1.0], 32)
    assert scales == [127] and elements[:2] == [0x7E, 0xB8]


def test_mxfp8_scale_rounds_up_past_448() -> None:
    # 449 needs 2**1: 449 / 2 = 224.5 rounds to 224 (0x76); 1.0 under 2**-8 is 256 (0x78)
    elements, scales = bytes_of(MX8, [449.0], 32)
    assert scales == [128] and elements[0] == 0x76
    elements, scales = bytes_of(MX8, [1.0], 32)
    assert scales == [119] and elements[0] == 0x78


def test_mxfp8_scale_range_ends() -> None:
    # a tiny group takes k = 0 (2**-127) and rounds to zero; decoding k = 0 keeps normal results and flushes
    # results below 2**-126 to zeros of their sign; k = 254 overflows 448 to infinity; 255 is NaN
    assert bytes_of(MX8, [2.0**-140], 32) == ([0] * 32, [0])
    elements = torch.tensor([[0x7E, 0x01, 0x81, 0x00] + [0] * 28], dtype=torch.uint8)
    low = decode(MX8, elements, torch.tensor([[0]], dtype=torch.uint8), torch.float32)[0]
    assert low[0] == 1.75 * 2.0**-119 and low[1] == 0 and not low[1].signbit() and low[2].signbit()
    high = decode(MX8, elements, torch.tensor([[254]], dtype=torch.uint8), torch.float32)[0]
    assert high[0] == float("inf") and high[1] == 2.0**118
    assert decode(MX8, elements, torch.tensor([[255]], dtype=torch.uint8), torch.float32).isnan().all()


def test_mxfp8_inf_saturates_and_nan_makes_the_scale_nan() -> None:
    elements, scales = bytes_of(MX8, [float("inf"), 1.0], 32)
    assert scales == [254] and elements[:2] == [0x7E, 0x00]
    assert bytes_of(MX8, [float("nan")], 32)[1] == [255]


# --- mxfp4: E2M1 elements, two a byte, a UE8M0 scale per 32 -------------------------------------------------------


def test_mxfp4_codes_ties_to_even_and_packing() -> None:
    values = [6.0, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 0.5, 3.0]
    elements, scales = bytes_of(MX4, values, 32)
    assert scales == [127]
    codes = [7, 15, 0, 2, 2, 4, 4, 6, 6, 8, 1, 5]
    assert elements[:6] == [lo | hi << 4 for lo, hi in zip(codes[0::2], codes[1::2], strict=True)]
    assert elements[6:] == [0] * 10


def test_mxfp4_scale_rounds_up_past_6() -> None:
    # 7 needs 2**1: 3.5 ties 3 / 4 and goes to 4 (code 6): 7 decodes as 8
    elements, scales = bytes_of(MX4, [7.0], 32)
    assert scales == [128] and elements[0] == 6
    assert decode(MX4, torch.tensor([elements]), torch.tensor([scales]), torch.float32)[0, 0] == 8.0


# --- every code, exactly ------------------------------------------------------------------------------------------


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    if exponent == 0xF and mantissa == 7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa * 2.0**-9
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def expected(value: float) -> float:
    """The decoding rule on an exact float64 product."""
    if value != value:
        return float("nan")
    if abs(value) < 2.0**-126:
        return 0.0
    return value if abs(value) < 2.0**128 else float("inf") * (1 if value > 0 else -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_every_element_and_scale_code_is_exact(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    for codec, scale_value in ((E4M3, e4m3_value), (MX8, lambda k: float("nan") if k == 255 else 2.0 ** (k - 127))):
        elements = codes.repeat(256).view(256, 256)[:, : 256 - 256 % codec.group].reshape(256, -1)
        scales = codes[:, None].expand(256, elements.shape[1] // codec.group).contiguous()
        got = decode(codec, elements, scales, dtype).float()
        want = torch.tensor(
            [
                [expected(e4m3_value(int(e)) * scale_value(int(s[i // codec.group]))) for i, e in enumerate(row)]
                for row, s in zip(elements, scales, strict=True)
            ]
        )
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_decoding_every_e2m1_code_pair() -> None:
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    elements = torch.arange(256, dtype=torch.uint8).view(16, 16)  # 32 E2M1 values a row
    got = decode(MX4, elements, torch.full((16, 1), 126, dtype=torch.uint8), torch.float32)
    want = [
        [(-1 if c & 8 else 1) * table[c & 7] / 2 for b in row for c in (b & 0xF, b >> 4)] for row in elements.tolist()
    ]
    assert got.tolist() == want


def test_decoded_nan_is_the_canonical_quiet_nan() -> None:
    byte = torch.uint8
    nan = decode(E4M3, torch.full((1, 16), 0x7F, dtype=byte), torch.ones(1, 1, dtype=byte), torch.float32)
    assert nan.view(torch.int32).eq(0x7FC00000).all()
    nan16 = decode(MX4, torch.zeros(1, 16, dtype=byte), torch.full((1, 1), 255, dtype=byte), torch.bfloat16)
    assert nan16.view(torch.int16).eq(0x7FC0).all()


STEPS = [("fp8-e4m3", 2.0**-3, 2.0**-9), ("mxfp8", 2.0**-3, 2.0**-9), ("mxfp4", 0.5, 0.5)]  # relative, smallest


@pytest.mark.parametrize(("codec", "relative", "smallest"), STEPS)
def test_a_round_trip_is_off_by_at_most_half_a_step(codec: str, relative: float, smallest: float) -> None:
    # no value saturates (the scale rounds up): each lands within half a step of the element grid, relative for
    # normal elements, the smallest step (times the group's scale) below them
    c = CODECS[codec]
    x = torch.randn(64, 128) * torch.logspace(-4, 4, 64)[:, None]
    elements, scales = encode(c, x)
    error = (decode(c, elements, scales, torch.float32) - x).abs()
    one = torch.full_like(elements, 0x38 if c.element == "e4m3" else 0x22)  # 1.0 (E2M1: two 1.0 a byte)
    scale = decode(c, one, scales, torch.float32)  # each value's group's scale
    assert (error <= torch.maximum(x.abs() * relative / 2, scale * smallest / 2)).all()


def test_bf16_rounds_to_nearest_even() -> None:
    x = torch.tensor([[1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8)]])
    elements, scales = encode(CODECS["bf16"], x)
    assert scales.numel() == 0
    assert decode(CODECS["bf16"], elements, scales, torch.float32).tolist() == [[1.0, 1 + 2.0**-6, -1.0]]


# --- layouts -----------------------------------------------------------------------------------------------------


def test_a_layout_places_elements_then_scales_then_padding_per_segment() -> None:
    # decoded block: 3 rows of 48 float32 values; channels 0-31 in mxfp8, the last 16 as bf16
    nope = Segment("mxfp8", rows=3, width=32, itemsize=4, src_offset=0, dst_offset=0, dst_row_stride=192)
    rope = Segment("bf16", rows=3, width=16, itemsize=4, src_offset=112, dst_offset=128, dst_row_stride=192)
    assert (nope.element_bytes, nope.scale_bytes, nope.encoded_bytes) == (96, 3, 112)
    assert rope.encoded_bytes == 96 and encoded_bytes((nope, rope)) == 208
    block = torch.randn(2, 3, 48)
    encoded = encode_rows(block.view(2, -1).view(torch.uint8), (nope, rope), torch.float32)
    assert encoded.shape == (2, 208)
    elements, scales = encode(CODECS["mxfp8"], block[:, :, :32])
    assert torch.equal(encoded[:, :96], elements.reshape(2, -1))
    assert torch.equal(encoded[:, 96:99], scales.reshape(2, -1))
    assert encoded[:, 99:112].eq(0).all()
    assert torch.equal(encoded[:, 112:208].view(torch.bfloat16).view(2, 3, 16), block[:, :, 32:].to(torch.bfloat16))
    decoded = decode_rows(encoded, (nope, rope), torch.float32).view(torch.float32).view(2, 3, 48)
    assert torch.equal(decoded[:, :, 32:], block[:, :, 32:].to(torch.bfloat16).float())
    assert torch.equal(decoded[:, :, :32], decode(CODECS["mxfp8"], elements, scales, torch.float32))
