"""Block keys: namespace digests and hash chains.

A prompt is cut into blocks of ``block_tokens`` tokens; block *i*'s key is

    h_0 = H(ns || tokens_0),   h_i = H(h_{i-1} || tokens_i)

with tokens as little-endian uint32 and ``ns`` the namespace digest. Equal keys therefore mean an equal
namespace *and* an equal prefix, which is what makes a key reusable across requests, processes and hosts.
``H`` is xxh3-128 (default, 16-byte keys) or sha256 (32-byte keys); never Python's ``hash()``, which is
salted per process.

Because xxh3 is not collision resistant, a stored block also records a *header digest* (blake2b over the
namespace digest, the parent key and the block's token ids). Readers that pass tokens compare it, so a key
collision can only ever cost a miss, never serve another prompt's KV.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

HASH_ALGOS = ("xxh3_128", "sha256")
HEADER_DIGEST_BYTES = 16
NO_HEADER = bytes(HEADER_DIGEST_BYTES)  # stored when the writer gave no tokens: readers then skip the check

TokenInput = Sequence[int] | np.ndarray | bytes | bytearray | memoryview


@dataclass(frozen=True)
class Namespace:
    """What makes two blocks' KV interchangeable: same model, dtype, block size, layout and tenant salt."""

    model_id: str
    kv_dtype: str
    block_tokens: int
    layout: str
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")

    @property
    def digest(self) -> bytes:
        """sha256 of a canonical JSON encoding of the fields: stable across processes, hosts and versions."""
        canonical = json.dumps(
            {
                "block_tokens": self.block_tokens,
                "kv_dtype": self.kv_dtype,
                "layout": self.layout,
                "model_id": self.model_id,
                "tenant": self.tenant,
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).digest()


def token_bytes(tokens: TokenInput) -> memoryview:
    """Tokens as little-endian uint32 bytes. Bytes-like input is taken as already encoded (no copy)."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        view = memoryview(tokens).cast("B")
        if len(view) % 4:
            raise ValueError(f"token bytes must be a multiple of 4 long, got {len(view)}")
        return view
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return memoryview(np.ascontiguousarray(arr, dtype="<u4")).cast("B")


def _hasher(algo: str):
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest
    if algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}")


def chain(ns: Namespace, tokens: TokenInput, algo: str = "xxh3_128") -> list[bytes]:
    """Keys of every *full* block of ``tokens``; a trailing partial block has no key."""
    data = token_bytes(tokens)
    block_bytes = ns.block_tokens * 4
    digest = _hasher(algo)
    keys: list[bytes] = []
    parent = ns.digest
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        parent = digest(parent + data[start : start + block_bytes])
        keys.append(parent)
    return keys


def header_digests(ns: Namespace, tokens: TokenInput, keys: Sequence[bytes]) -> list[bytes]:
    """Header digests of ``keys``, the chain over ``tokens`` from block 0 (all of it or a prefix).

    The digest binds the namespace, the parent key and the block's own token ids; the node stores it with
    every shard, and a reader that passes tokens gets a miss (counted) if it differs.
    """
    data = token_bytes(tokens)
    block_bytes = ns.block_tokens * 4
    if len(keys) * block_bytes > len(data):
        raise ValueError(f"{len(keys)} keys need {len(keys) * ns.block_tokens} tokens, got {len(data) // 4}")
    ns_digest = ns.digest
    out = []
    parent = ns_digest
    for i, key in enumerate(keys):
        h = hashlib.blake2b(digest_size=HEADER_DIGEST_BYTES)
        h.update(ns_digest)
        h.update(parent)
        h.update(data[i * block_bytes : (i + 1) * block_bytes])
        out.append(h.digest())
        parent = key
    return out
