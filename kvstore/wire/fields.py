"""Batch encodings shared by client and node: how keys, indices and statuses travel inside metadata.

A batch of ``n`` entries travels as a few ``bin`` fields rather than ``n`` msgpack objects, so encoding
and decoding a 1,200-key request is a handful of numpy calls:

    keys   n × key_len bytes, concatenated       klen  key length (16 or 32)
    idx    n × uint8 shard indices               hdr   n × 16-byte header digests, or absent
    lens   n × little-endian uint32 lengths      blen  n × little-endian uint64 block lengths
    st     n × uint8 Status values              rec   n × uint8 RecordState values (probe replies)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.kvstore.keys import HEADER_DIGEST_BYTES
from kvtier.kvstore.wire.protocol import ErrorCode, ProtocolError

KEY_LENGTHS = (16, 32)


class RecordState(enum.IntEnum):
    """What a probe reply's ``rec`` column says of the block record at a holder of shard 0, 1 or 2."""

    NONE = 0  # no record here (never written, lost with a wiped disk, or deleted)
    HELD = 1
    REMOVING = 2  # the primary removed the block and is still deleting its shards: nothing may bring it back


def pack_keys(keys: Sequence[bytes]) -> tuple[bytes, int]:
    if not keys:
        return b"", 16
    klen = len(keys[0])
    blob = b"".join(keys)
    if klen not in KEY_LENGTHS or len(blob) != klen * len(keys):
        raise ValueError(f"keys must all be {KEY_LENGTHS[0]} or {KEY_LENGTHS[1]} bytes long")
    return blob, klen


def bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def field(meta: dict[str, Any], name: str, kind: type) -> Any:
    value = meta.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise bad(f"field {name!r} must be {kind.__name__}")
    return value


def unpack_keys(meta: dict[str, Any], max_batch: int) -> list[bytes]:
    blob, klen = unpack_key_blob(meta, max_batch)
    return [blob[i : i + klen] for i in range(0, len(blob), klen)]


def unpack_key_blob(meta: dict[str, Any], max_batch: int) -> tuple[bytes, int]:
    """The ``keys`` blob, checked (a whole number of keys of a known length, at most ``max_batch``), and ``klen``."""
    blob = field(meta, "keys", bytes)
    klen = field(meta, "klen", int)
    if klen not in KEY_LENGTHS:
        raise bad(f"key length {klen} is not one of {KEY_LENGTHS}")
    if len(blob) % klen:
        raise bad("keys blob is not a whole number of keys")
    n = len(blob) // klen
    if n > max_batch:
        raise bad(f"batch of {n} keys exceeds the limit of {max_batch}")
    return blob, klen


def unpack_array(meta: dict[str, Any], name: str, dtype: str, n: int) -> np.ndarray:
    blob = field(meta, name, bytes)
    if len(blob) != np.dtype(dtype).itemsize * n:
        raise bad(f"field {name!r} must hold {n} values")
    return np.frombuffer(blob, dtype=dtype)


def unpack_headers(meta: dict[str, Any], n: int) -> list[bytes | None]:
    blob = unpack_header_blob(meta, n)
    if blob is None:
        return [None] * n
    return [blob[i * HEADER_DIGEST_BYTES : (i + 1) * HEADER_DIGEST_BYTES] for i in range(n)]


def unpack_header_blob(meta: dict[str, Any], n: int) -> bytes | None:
    """The ``hdr`` blob (``n`` digests, concatenated), checked, or None when the request carries none."""
    blob = meta.get("hdr")
    if blob is not None and (not isinstance(blob, bytes) or len(blob) != n * HEADER_DIGEST_BYTES):
        raise bad(f"field 'hdr' must hold {n} digests of {HEADER_DIGEST_BYTES} bytes")
    return blob
