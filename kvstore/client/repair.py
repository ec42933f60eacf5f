"""What the GC's repair asks of the cluster: which shards and block records exist (metadata only), which blocks
a peer holds shards of, and whole blocks decoded from their shards even where the primary lost its record.
Rewriting is ``write_shards`` (write path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtier.kvstore.client.core import Survey
from kvtier.kvstore.client.reads import Reads, ReadState
from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.wire.protocol import Op
from kvtier.kvstore.wire.requests import PAGE_BLOCKS
from kvtier.kvstore.wire.transport import Exchange


class Decoded(NamedTuple):
    """A block read for repair: its bytes, and the header digest and TTL class its shards carry."""

    data: bytearray
    header: bytes
    ttl_class: str | None


class Repairs(Reads):
    """``survey``, ``probe``, ``blocks_held`` and ``read_for_repair``."""

    def survey(self, keys: Sequence[bytes]) -> Survey:
        """Ask the 12 holders of every block which of its shards they store and, at the holders of shards 0,
        1 and 2, whether they keep its record. Metadata only, one request per node."""
        return self._probe(keys, np.ones((len(keys), TOTAL_SHARDS), dtype=bool))

    def probe(self, keys: Sequence[bytes]) -> np.ndarray:
        """(n × 12) whether each shard of each block is stored, committed and (shard 0) recorded.

        Metadata only; an unreachable node's shards read as absent.
        """
        return self.survey(keys).present

    def blocks_held(
        self, node_id: int, of_node: int, before: float | None = None
    ) -> dict[str, dict[bytes, float]] | None:
        """Every block ``node_id`` holds a shard of that has a shard at ``of_node`` (the blocks a node rebuilding
        after its data was lost should hold), committed there ``before`` that time if given, per tenant: key →
        the shard's commit time. Asked page by page (admin ``blocks_held``); None when the node did not answer
        every page."""
        found: dict[str, dict[bytes, float]] = {}
        start: int | None = 0
        while start is not None:
            exchange = Exchange(self.pool)
            meta = {"action": "blocks_held", "node": of_node, "start": start, "limit": PAGE_BLOCKS}
            if before is not None:
                meta["before"] = float(before)
            pending = exchange.request(node_id, Op.ADMIN, meta)
            exchange.run(self.config.client.op_timeout_s)
            if not pending.ok or pending.frame is None:
                return None
            reply = pending.frame.meta
            for group in reply["groups"]:
                keys, klen, created = group["keys"], group["klen"], np.frombuffer(group["created"], dtype="<f8")
                blocks = found.setdefault(group["tenant"], {})
                for i, when in enumerate(created.tolist()):
                    key = keys[i * klen : (i + 1) * klen]
                    blocks[key] = min(when, blocks.get(key, when))
            start = reply["next"]
        return found

    def read_for_repair(self, keys: Sequence[bytes]) -> list[Decoded | None]:
        """Whole blocks decoded from their shards, even where the primary lost its record, each with the
        header digest and TTL class its shards carry (a repair writes them back unchanged); None where fewer
        than 10 shards could be read."""
        buffers: list[memoryview | None] = [None] * len(keys)
        state = ReadState(len(keys), buffers, True, trust_primary=False)
        found = self._read(keys, buffers, True, None, state=state, repair=False)
        stored = state.stored_as(range(len(keys)))
        return [
            Decoded(buf.obj, header, ttl_class) if hit and buf is not None else None
            for hit, buf, (ttl_class, header) in zip(found, buffers, stored, strict=True)
        ]
