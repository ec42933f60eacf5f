"""KV formats: the form an engine's blocks and StateBlocks take outside its device (store, fetcher's pool, wire,
StateBlock pool, directory), chosen per engine (``Engine(kv_format=)``, ``--kv-format``).

A model family declares its block and its StateBlock as :class:`Part` s, in order (``Family.kv_parts``): what kind
of tensor each is, how many rows of how many values, and how many trailing channels of a row carry RoPE. A format
names a codec (``kernels/kvquant.py``) per kind of part:

| kind | what | dense families | DeepSeek-V4 |
|---|---|---|---|
| ``main`` | the block's attention KV | every global layer's K and V | the compressors' entries |
| ``index`` | keys only a selection reads | – | the indexers' keys |
| ``window`` | a StateBlock's sliding-window rows | every sliding layer's K and V | every layer's window rows |
| ``state`` | the rest of a StateBlock | – | partial windows, overlap state, gates (always ``exact``) |

and, with ``rope=CODEC``, one for the RoPE channels of every part that is not exact (otherwise they take their
part's codec). The named formats:

| format | main | index | window | what for |
|---|---|---|---|---|
| ``exact`` (default) | exact | exact | exact | today's bytes: the compute dtype |
| ``bf16`` | bf16 | bf16 | bf16 | a float32 engine's KV at half the bytes |
| ``fp8-e4m3`` | fp8-e4m3 | fp8-e4m3 | fp8-e4m3 | the seed's per-16 format everywhere |
| ``mxfp8`` | mxfp8 | mxfp8 | mxfp8 | |
| ``mxfp4`` | mxfp4 | mxfp4 | mxfp4 | |
| ``seed`` | fp8-e4m3 | mxfp4 | mxfp8 | the seed's formats per part (SWA 528 B a token at width 512) |

or ``KIND=CODEC,...`` (kinds not named stay exact), e.g. ``main=fp8-e4m3,rope=bf16``.

A :class:`Layout` is one block's (or StateBlock's) stored form under a format. The format is part of the keys: the
namespace's ``kv_dtype`` is the compute dtype for ``exact`` (today's keys) and otherwise names the format's version,
the compute dtype, each kind's codec and a digest of the layout's every segment, so a reader never decodes one format
as another and engines of different formats share no block (a block of another format is a miss).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvtier.kernels.dequant import DecodeRows
from kvtier.kernels.kvquant import CODECS, Segment, check_dtype, decode_rows, encode_rows, layout_key

VERSION = "kvformat.v1"
KINDS = ("main", "index", "window", "state")
LOSSY_KINDS = ("main", "index", "window")
PRESETS: dict[str, dict[str, str]] = {
    "exact": {},
    **{codec: dict.fromkeys(LOSSY_KINDS, codec) for codec in ("bf16", "fp8-e4m3", "mxfp8", "mxfp4")},
    "seed": {"main": "fp8-e4m3", "index": "mxfp4", "window": "mxfp8"},
}


class FormatError(ValueError):
    """A format that does not parse, or that this model's parts cannot take (one line)."""


@dataclass(frozen=True)
class Part:
    """A region of a block or StateBlock: ``rows × width`` values of ``itemsize`` bytes (1 for opaque bytes, which
    stay exact), the last ``rope`` of each row carrying RoPE."""

    kind: str
    rows: int
    width: int
    itemsize: int
    rope: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * self.itemsize


@dataclass(frozen=True)
class KVFormat:
    """A codec per kind of part (kinds not listed are ``exact``) and, under ``rope``, the RoPE channels' codec."""

    name: str
    codecs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> KVFormat:
        """A named format or ``KIND=CODEC,...`` (FormatError, one line, for anything else)."""
        text = text.strip()
        if text in PRESETS:
            return cls(text, tuple(sorted(PRESETS[text].items())))
        chosen: dict[str, str] = {}
        for item in text.split(","):
            kind, sep, codec = (s.strip() for s in item.partition("="))
            if not sep or kind not in (*KINDS, "rope") or codec not in CODECS:
                raise FormatError(
                    f"KV format {text!r}: use one of {', '.join(PRESETS)} or KIND=CODEC,... with KIND in "
                    f"{', '.join((*KINDS, 'rope'))} and CODEC in {', '.join(CODECS)}"
                )
            if kind == "state" and codec != "exact":
                raise FormatError(f"KV format {text!r}: state (accumulators, float32 gates) stays exact")
            chosen[kind] = codec
        plain = {k: c for k, c in chosen.items() if c != "exact" or k == "rope"}
        named = [name for name, codecs in PRESETS.items() if codecs == plain]
        return cls(named[0] if named else text, tuple(sorted(plain.items())))

    def codec(self, kind: str) -> str:
        return dict(self.codecs).get(kind, "exact")

    def layouts(self, parts: tuple[list[Part], list[Part]], dtype: torch.dtype) -> tuple[Layout, Layout]:
        """The stored forms of a block and of a StateBlock (``parts``: ``Family.kv_parts``' two lists); FormatError
        (one line) as :meth:`layout`."""
        blocks, states = parts
        return self.layout(blocks, dtype, "blocks"), self.layout(states, dtype, "StateBlocks")

    def layout(self, parts: list[Part], dtype: torch.dtype, what: str) -> Layout:
        """The stored form of a block (or StateBlock, ``what`` says which) made of ``parts``, values in ``dtype``.
        FormatError (one line) where a part's rows cannot take its codec."""
        decoded = sum(p.nbytes for p in parts)
        codecs = {self.codec(p.kind) for p in parts} | ({self.codec("rope")} if any(p.rope for p in parts) else set())
        if codecs <= {"exact"}:
            return Layout((), decoded, decoded, str(dtype).removeprefix("torch."), dtype)
        try:
            check_dtype(dtype, f"KV format {self.name}")
        except ValueError as e:
            raise FormatError(str(e)) from None
        segments: list[Segment] = []
        src = dst = 0
        for p in parts:
            for codec, first, width in _columns(p, self.codec(p.kind), dict(self.codecs).get("rope")):
                if p.itemsize == 1 and codec != "exact":
                    raise FormatError(f"{what}: {p.kind} holds opaque bytes, which stay exact")
                try:
                    CODECS[codec].check(width, f"{what}: the {p.kind} rows' {width} channels")
                except ValueError as e:
                    raise FormatError(f"KV format {self.name}: {e}") from None
                stride = p.width * p.itemsize
                segment = Segment(codec, p.rows, width, p.itemsize, src, dst + first * p.itemsize, stride)
                segments.append(segment)
                src += segment.encoded_bytes
            dst += p.nbytes
        kinds = "".join(f"[{k}:{c}]" for k, c in self.codecs if k == "rope" or k in {p.kind for p in parts})
        digest = hashlib.sha256(layout_key(tuple(segments)).encode()).hexdigest()[:16]
        name = f"{VERSION}[{str(dtype).removeprefix('torch.')}]{kinds}#{digest}"
        return Layout(tuple(segments), decoded, src, name, dtype)


def _columns(part: Part, codec: str, rope: str | None) -> list[tuple[str, int, int]]:
    """The part's channels as (codec, first channel, channels): whole, or with the RoPE channels apart (only in a
    part that is not exact: ``rope`` keeps RoPE channels wider, never narrower)."""
    if not part.rope or rope is None or rope == codec or codec == "exact":
        return [(codec, 0, part.width)]
    split = part.width - part.rope
    return [(codec, 0, split), (rope, split, part.rope)]


@dataclass(frozen=True)
class Layout:
    """One block's (or StateBlock's) stored form: ``segments`` (none: the decoded bytes as they are), a block of
    ``decoded_bytes`` in the compute dtype stored as ``encoded_bytes``; ``kv_dtype`` names it in a namespace."""

    segments: tuple[Segment, ...]
    decoded_bytes: int
    encoded_bytes: int
    kv_dtype: str
    dtype: torch.dtype

    @property
    def identity(self) -> bool:
        return not self.segments

    def encode(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks (uint8 [n, decoded_bytes], any device) in stored form, uint8 [n, encoded_bytes] on their device."""
        return blocks if self.identity else encode_rows(blocks, self.segments, self.dtype)

    def decode(self, stored: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stored blocks (uint8 [n, ≥ encoded_bytes]) as decoded bytes: into ``out`` (uint8 [n, decoded_bytes]) if
        given; returns it."""
        if self.identity:
            stored = stored[:, : self.decoded_bytes]
            return stored if out is None else out.copy_(stored)
        return decode_rows(stored[:, : self.encoded_bytes], self.segments, self.dtype, out)

    @property
    def decoder(self) -> DecodeRows | None:
        """What ``swap_in`` takes to decode on the way (None for the identity)."""
        return None if self.identity else _decoder(self)


_decoders: dict[Layout, DecodeRows] = {}


def _decoder(layout: Layout) -> DecodeRows:
    """One :class:`DecodeRows` per layout (it keeps the kernel's tile table on each device)."""
    found = _decoders.get(layout)
    if found is None:
        found = _decoders[layout] = DecodeRows(layout.segments, layout.dtype)
    return found
