"""The engine's side of the store: one namespace, block reads into pages, block writes from pages.

A store that is down or refuses us is never a failed request: every call here answers as a miss (``match``
0, nothing fetched, nothing stored) and the engine recomputes. It is never silent either: the first call that finds
the store away logs one line, the first that finds it back another, and both are counted (``availability``, in
the engine's ``stats``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvtier.kvstore.client import CapacityError, Client, connect
from kvtier.kvstore.keys import Namespace, chain
from kvtier.kvstore.protocol import ProtocolError
from kvtier.kvstore.transport import AuthError
from kvtier.transfer.availability import Availability

log = logging.getLogger("kvtier.engine")

STORE_ERRORS = (OSError, ProtocolError, AuthError)  # the store is away, or refuses this engine


class BlockStore:
    """Blocks of one namespace in one cluster. Methods never raise for the store's sake (see module doc)."""

    def __init__(self, client: Client, namespace: Namespace) -> None:
        self.client = client
        self.namespace = namespace
        self.hash_algo = client.config.hash_algo
        self.availability = Availability("the store", "the engine recomputes what it cannot reach", log)
        self._full_logged = False

    @classmethod
    def open(cls, cluster_file: str | Path, namespace: Namespace, token: str | None = None) -> BlockStore:
        return cls(connect(cluster_file, token=token, namespace=namespace), namespace)

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Chain keys of every full block of ``tokens``."""
        return chain(self.namespace, np.asarray(tokens, dtype=np.uint32), self.hash_algo)

    def match(self, keys: Sequence[bytes]) -> int:
        """Leading keys stored (0 when the store cannot answer)."""
        try:
            live = self.client.liveness(keys)  # per key 1 held, 0 not, -1 unknown (its primary did not answer)
        except STORE_ERRORS as e:
            self.availability.failed(e)
            return 0
        misses = np.flatnonzero(live != 1)
        hit = int(misses[0]) if len(misses) else len(keys)
        if hit < len(keys) and live[hit] == -1:  # a miss only because the store could not answer
            self.availability.failed(f"the node holding the record of block {hit} of the prompt did not answer")
        else:
            self.availability.answered()
        return hit

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[memoryview],
        tokens: Sequence[int],
        on_landed: Callable[[int, int], None] | None = None,
    ) -> int:
        """Read blocks into ``buffers``; returns how many *leading* blocks landed (header-checked against
        ``tokens``, so a collision is a miss). ``on_landed(lo, hi)``: told as ranges of blocks are done, from the
        threads that read them (``Client.get_into``)."""
        if not keys:
            return 0
        try:
            got = self.client.get_into(keys, buffers, tokens=np.asarray(tokens, dtype=np.uint32), on_landed=on_landed)
        except STORE_ERRORS as e:
            self.availability.failed(e)
            return 0
        misses = [i for i, ok in enumerate(got) if not ok]
        landed = misses[0] if misses else len(keys)
        if landed:  # (nothing read may be misses, or nodes away: only ``match`` tells them apart)
            self.availability.answered()
        return landed

    def put(self, keys: Sequence[bytes], buffers: Sequence[memoryview], tokens: Sequence[int]) -> int:
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
