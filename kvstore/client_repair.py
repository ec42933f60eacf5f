"""What the GC's repair asks of the cluster: which shards exist (metadata only), and whole blocks decoded from
their shards even where the primary lost its record. Rewriting is ``write_shards`` (write path)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.kvstore.client_core import _by_node, key_rows
from kvtier.kvstore.client_reads import Reads, ReadState
from kvtier.kvstore.protocol import Op, Status
from kvtier.kvstore.transport import Exchange


class Repairs(Reads):
    """``probe`` and ``read_for_repair``."""

    def probe(self, keys: Sequence[bytes]) -> np.ndarray:
        """(n × 12) whether each shard of each block is stored, committed and (shard 0) recorded.

        Metadata only; an unreachable node's shards read as absent.
        """
        shard_nodes = self.placement.shard_nodes(keys)
        present = np.zeros(shard_nodes.shape, dtype=bool)
        exchange = Exchange(self.pool)
        asks = []
        key_table = key_rows(keys)  # once, not per request
        for node_id, entries in _by_node(shard_nodes, np.ones(shard_nodes.shape, dtype=bool)):
            meta = {**self._entry_meta(key_table, entries, None), "probe": True}
            asks.append((entries, exchange.request(node_id, Op.GET_SHARDS, meta)))
        exchange.run(self.config.client.op_timeout_s)
        for entries, pending in asks:
            statuses = self._flags(pending, "st", len(entries))
            if statuses is not None:
                ok = entries[statuses == Status.OK]
                present[ok[:, 0], ok[:, 1]] = True
        return present

    def read_for_repair(self, keys: Sequence[bytes]) -> list[tuple[bytearray, bytes] | None]:
        """Whole blocks decoded from their shards, even where the primary lost its record, each with the
        header digest its shards carry (a repair writes it back unchanged)."""
        buffers: list[memoryview | None] = [None] * len(keys)
        state = ReadState(len(keys), buffers, True, trust_primary=False)
        found = self._read(keys, buffers, True, None, state=state, repair=False)
        headers = [header for _, header in state.stored_as(range(len(keys)))]
        return [
            (buf.obj, headers[b]) if hit and buf is not None else None
            for b, (hit, buf) in enumerate(zip(found, buffers, strict=True))
        ]
