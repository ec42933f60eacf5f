"""The engine's side of the store: one namespace, block reads into pages, block writes from pages.

A store that is down or refuses us is never a failed request: every call here answers as a miss (``match``
0, nothing fetched, nothing stored) and the engine recomputes. It is never silent either: the first call that finds
the store away logs one line, the first that finds it back another, and both are counted (``availability``, in
the engine's ``stats``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.kvstore.client import CapacityError, Client, connect
from kvtier.kvstore.client.read_watch import ReadWatch
from kvtier.kvstore.keys import Namespace, TokenInput, chain, header_digests, token_bytes
from kvtier.kvstore.wire.protocol import ProtocolError
from kvtier.kvstore.wire.transport import AuthError
from kvtier.transfer.availability import Availability

log = logging.getLogger("kvtier.engine")

STORE_ERRORS = (OSError, ProtocolError, AuthError)  # the store is away, or refuses this engine


@dataclass
class _Chain:
    """The keys of one token sequence's full blocks and, once asked for, their header digests."""

    data: bytes  # the tokens, as uint32 bytes
    keys: list[bytes]
    digests: dict[bytes, bytes] = field(default_factory=dict)  # by key; empty until first asked for


class BlockStore:
    """Blocks of one namespace in one cluster. Methods never raise for the store's sake (see module doc).

    The chain of the last tokens given is kept: one request's lookup, fetch and header checks chain the same
    prompt (or a prefix of it), which costs ~5 µs a block in Python (7 ms at 77K tokens, each time)."""

    def __init__(self, client: Client, namespace: Namespace) -> None:
        self.client = client
        self.namespace = namespace
        self.hash_algo = client.config.hash_algo
        self.availability = Availability("the store", "the engine recomputes what it cannot reach", log)
        self._full_logged = False
        self._last: _Chain | None = None

    @classmethod
    def open(cls, cluster_file: str | Path, namespace: Namespace, token: str | None = None) -> BlockStore:
        return cls(connect(cluster_file, token=token, namespace=namespace), namespace)

    def keys(self, tokens: TokenInput) -> list[bytes]:
        """Chain keys of every full block of ``tokens``."""
        data = token_bytes(np.asarray(tokens, dtype=np.uint32))
        return self._chain(data).keys[: len(data) // (4 * self.namespace.block_tokens)]

    def headers(self, keys: Sequence[bytes], tokens: TokenInput) -> list[bytes]:
        """Header digests of ``keys``, blocks of the chain over ``tokens`` (ValueError for a key that is not)."""
        chained = self._chain(token_bytes(np.asarray(tokens, dtype=np.uint32)))
        if not chained.digests:
            digests = header_digests(self.namespace, chained.data, chained.keys)
            chained.digests = dict(zip(chained.keys, digests, strict=True))
        try:
            return [chained.digests[k] for k in keys]
        except KeyError:
            raise ValueError("keys that are not blocks of the given tokens in this namespace") from None

    def _chain(self, data: memoryview) -> _Chain:
        """The kept chain if ``data`` is a prefix of its tokens, else the chain of ``data`` (kept from now on)."""
        last = self._last
        if last is None or not last.data.startswith(data):
            last = self._last = _Chain(bytes(data), chain(self.namespace, data, self.hash_algo))
        return last

    def match(self, keys: Sequence[bytes]) -> int:
        """Leading keys stored (0 when the store cannot answer)."""
        try:
            live = self.client.liveness(keys)  # per key 1 held, 0 not, -1 unknown (no holder of its record answered)
        except STORE_ERRORS as e:
            self.availability.failed(e)
            return 0
        misses = np.flatnonzero(live != 1)
        hit = int(misses[0]) if len(misses) else len(keys)
        if hit < len(keys) and live[hit] == -1:  # a miss only because the store could not answer
            self.availability.failed(f"no node holding the record of block {hit} of the prompt answered")
        else:
            self.availability.answered()
        return hit

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[memoryview],
        tokens: TokenInput,
        on_landed: Callable[[int, int], None] | None = None,
        watch: ReadWatch | None = None,
    ) -> int:
        """Read blocks into ``buffers``; returns how many *leading* blocks landed (header-checked against
        ``tokens``, so a collision is a miss). ``on_landed(lo, hi)``: told as ranges of blocks are done, from the
        threads that read them; ``watch``: asked by another thread which blocks have settled meanwhile (both as
        ``Client.get_into`` says)."""
        if not keys:
            return 0
        try:
            headers = self.headers(keys, tokens)
            got = self.client.get_into(keys, buffers, headers=headers, on_landed=on_landed, watch=watch)
        except STORE_ERRORS as e:
            self.availability.failed(e)
            return 0
        misses = [i for i, ok in enumerate(got) if not ok]
        landed = misses[0] if misses else len(keys)
        if landed:  # (nothing read may be misses, or nodes away: only ``match`` tells them apart)
            self.availability.answered()
        return landed

    def put(self, keys: Sequence[bytes], buffers: Sequence[memoryview], tokens: TokenInput) -> int:
        """Store blocks (``tokens``: the prompt the keys were chained from); returns how many are stored."""
        if not keys:
            return 0
        try:
            stored = sum(self.client.put(keys, buffers, tokens=np.asarray(tokens, dtype=np.uint32)))
        except STORE_ERRORS as e:
            self.availability.failed(e)
            return 0
        except CapacityError as e:  # the store answers, but is full of blocks it cannot evict
            if not self._full_logged:
                self._full_logged = True
                log.warning("the store is full, blocks are not stored (logged once): %s", e)
            stored = sum(e.stored)
        if stored:  # (nothing stored: nodes away, or the store full; ``match`` tells which)
            self.availability.answered()
        return stored

    def close(self) -> None:
        self.client.close()
