"""The engine's side of the store: one namespace, block reads into pages, block writes from pages.

A store that is down or refuses us is never a failed request: every call here answers as a miss (``match``
0, nothing fetched, nothing stored), logs one line per kind of failure, and the engine recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvtier.kvstore.client import CapacityError, Client, connect
from kvtier.kvstore.keys import Namespace, chain
from kvtier.kvstore.protocol import ProtocolError
from kvtier.kvstore.transport import AuthError

log = logging.getLogger("kvtier.engine")

STORE_ERRORS = (OSError, ProtocolError, AuthError, CapacityError)


class BlockStore:
    """Blocks of one namespace in one cluster. Methods never raise for the store's sake (see module doc)."""

    def __init__(self, client: Client, namespace: Namespace) -> None:
        self.client = client
        self.namespace = namespace
        self.hash_algo = client.config.hash_algo
        self._warned: set[str] = set()

    @classmethod
    def open(cls, cluster_file: str | Path, namespace: Namespace, token: str | None = None) -> BlockStore:
        return cls(connect(cluster_file, token=token, namespace=namespace), namespace)

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Chain keys of every full block of ``tokens``."""
        return chain(self.namespace, np.asarray(tokens, dtype=np.uint32), self.hash_algo)

    def match(self, keys: Sequence[bytes]) -> int:
        """Leading keys stored (0 when the store cannot answer)."""
        try:
            return self.client.match(keys)
        except STORE_ERRORS as e:
            self._warn("match", e)
            return 0

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview], tokens: Sequence[int]) -> int:
        """Read blocks into ``buffers``; returns how many *leading* blocks landed (header-checked against
        ``tokens``, so a collision is a miss)."""
        if not keys:
            return 0
        try:
            got = self.client.get_into(keys, buffers, tokens=np.asarray(tokens, dtype=np.uint32))
        except STORE_ERRORS as e:
            self._warn("get", e)
            return 0
        misses = [i for i, ok in enumerate(got) if not ok]
        return misses[0] if misses else len(keys)

    def put(self, keys: Sequence[bytes], buffers: Sequence[memoryview], tokens: Sequence[int]) -> int:
        """Store blocks (``tokens``: the prompt the keys were chained from); returns how many are stored."""
        if not keys:
            return 0
        try:
            return sum(self.client.put(keys, buffers, tokens=np.asarray(tokens, dtype=np.uint32)))
        except STORE_ERRORS as e:
            self._warn("put", e)
            return sum(e.stored) if isinstance(e, CapacityError) else 0

    def close(self) -> None:
        self.client.close()

    def _warn(self, what: str, error: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("store %s failed, recomputing instead: %s", what, error)
