"""Metadata lookups, deletes and operator calls: small requests, no payloads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.kvstore.client_core import ClientCore
from kvtier.kvstore.protocol import Op
from kvtier.kvstore.transport import Exchange
from kvtier.kvstore.wire import pack_keys

_ANY_SHARD = 255  # a DELETE's ``idx`` for a key of which the node holds several shards: it looks among all


class Lookups(ClientCore):
    """``match``, ``exists``, ``liveness``, ``delete``, ``stat`` and the admin calls (see ``Client``)."""

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are all stored and live (metadata only: asks each key's primary)."""
        live = self._live(keys)
        misses = np.flatnonzero(~live)
        return int(misses[0]) if len(misses) else len(keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored and live (metadata only). A down primary reads as absent."""
        return self._live(keys).tolist()

    def _live(self, keys: Sequence[bytes]) -> np.ndarray:
        return self.liveness(keys) == 1

    def liveness(self, keys: Sequence[bytes]) -> np.ndarray:
        """Per key: 1 stored and live, 0 not (its primary said so), -1 unknown (primary unreachable)."""
        live = np.full(len(keys), -1, dtype=np.int8)
        if not keys:
            return live
        primaries = self.placement.primaries(keys)
        blob, klen = pack_keys(keys)
        table = np.frombuffer(blob, dtype=np.uint8).reshape(len(keys), klen)
        exchange = Exchange(self.pool)
        asks = []
        for node_id in np.unique(primaries).tolist():
            positions = np.flatnonzero(primaries == node_id)
            meta = {"keys": table[positions].tobytes(), "klen": klen}
            asks.append((positions, exchange.request(node_id, Op.MATCH, meta)))
        exchange.run(self.config.client.op_timeout_s)
        for positions, pending in asks:
            flags = self._flags(pending, "live", len(positions))
            if flags is not None:
                live[positions] = flags.astype(bool)
        return live

    def delete(self, keys: Sequence[bytes], before: float | None = None, primary_done: int | None = None) -> bool:
        """Remove blocks: all 12 nodes of each block's group drop its shards and records (the primary's and
        shard 1's copy). Returns whether every one of those nodes answered.

        ``before`` (seconds since the epoch; the GC's evictions pass their time) spares records and shards
        written after it, so a block stored again meanwhile is not harmed. A node that is down keeps its
        shards, which no reader is given once the primary's record is gone; they go when they expire (the
        GC, which removes blocks itself, retries its DELETEs until every node answered).

        ``primary_done``: the node that already removed these blocks' records and shard 0s (their primary, in
        the transaction that wrote its eviction intents): it is asked only about other shards it holds.
        Each node is told which shard each key has there (``idx``), or to look among all of them where it
        holds several.
        """
        if not keys:
            return True
        shard_nodes = self.placement.shard_nodes(keys)
        blob, klen = pack_keys(keys)
        table = np.frombuffer(blob, dtype=np.uint8).reshape(len(keys), klen)
        exchange = Exchange(self.pool)
        asks = []
        for node_id in np.unique(shard_nodes).tolist():
            held = shard_nodes == node_id
            count = held.sum(axis=1)
            asked = count - held[:, 0] if node_id == primary_done else count
            positions = np.flatnonzero(asked)
            if not len(positions):
                continue
            index = np.where(count[positions] == 1, held[positions].argmax(axis=1), _ANY_SHARD).astype(np.uint8)
            meta: dict[str, Any] = {"keys": table[positions].tobytes(), "klen": klen, "idx": index.tobytes()}
            if before is not None:
                meta["before"] = float(before)
            asks.append(exchange.request(node_id, Op.DELETE, meta))
        exchange.run(self.config.client.op_timeout_s)
        return all(pending.ok for pending in asks)

    def stat(self, key: bytes) -> dict[str, Any]:
        """Where a block's shards live and what its primary records (for operators)."""
        nodes = self.placement.shard_nodes([key])[0].tolist()
        exchange = Exchange(self.pool)
        asks = {nid: exchange.request(nid, Op.STAT, {"key": key}) for nid in sorted(set(nodes))}
        exchange.run(self.config.client.op_timeout_s)
        out: dict[str, Any] = {"key": key.hex(), "primary": nodes[0], "block": None, "shards": []}
        for nid, pending in asks.items():
            if not pending.ok:
                out["shards"].append({"node": nid, "error": pending.error})
                continue
            assert pending.frame is not None
            meta = pending.frame.meta
            # the primary's record, else the copy kept by the holder of shard 1
            if nid == nodes[0] or (nid == nodes[1] and out["block"] is None):
                out["block"] = meta["block"] or out["block"]
            out["shards"].extend({"node": nid, **s} for s in meta["shards"])
        return out

    def admin(self, action: str, node_ids: Sequence[int] | None = None, **meta: Any) -> dict[int, dict[str, Any]]:
        """Run an admin action (cluster token only) on nodes (default: all); per node its reply or
        ``{"error": why}`` (``"down"`` for an unreachable node)."""
        return self._each_node(Op.ADMIN, {"action": action, **meta}, node_ids)

    def node_info(self, node_ids: Sequence[int] | None = None) -> dict[int, dict[str, Any]]:
        """Usage, capacity, watermarks, counts, TTL table and GC state of nodes (cluster token only)."""
        return self._each_node(Op.NODE_INFO, {}, node_ids)

    def _each_node(self, op: Op, meta: dict[str, Any], node_ids: Sequence[int] | None) -> dict[int, dict[str, Any]]:
        exchange = Exchange(self.pool)
        ids = sorted(self.config.nodes) if node_ids is None else list(node_ids)
        asks = {nid: exchange.request(nid, op, meta) for nid in ids}
        exchange.run(self.config.client.op_timeout_s)
        return {
            nid: dict(p.frame.meta) if p.ok and p.frame is not None else {"error": p.error or "no reply"}
            for nid, p in asks.items()
        }
