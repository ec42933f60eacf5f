"""Placement: which nodes hold which shards of a block, computed for whole batches at once.

A block belongs to placement group ``h mod G`` (``h`` = the key's first 8 bytes, little-endian) and its
shards rotate over the group's 12 slots by ``(h // G) mod 12``: shard ``i`` lives in slot
``(i + rot) mod 12``. Parity shards and primaries (the holder of data shard 0, which also keeps the block
record) therefore spread evenly over a group's nodes. Everything is numpy so that planning a 1,200-key
batch costs microseconds, not a Python loop per key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvtier.kvstore.codec import TOTAL_SHARDS


class Placement:
    """Maps keys to node ids for one version of the cluster map."""

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        table = np.asarray(groups, dtype=np.int64)
        if table.ndim != 2 or table.shape[1] != TOTAL_SHARDS:
            raise ValueError(f"placement groups must each have {TOTAL_SHARDS} slots")
        self.groups = table
        self.node_ids = sorted({int(n) for n in table.ravel()})

    def shard_nodes(self, keys: Sequence[bytes]) -> np.ndarray:
        """``out[b, i]`` is the node id holding shard ``i`` of ``keys[b]``; shape (len(keys), 12)."""
        if not keys:
            return np.empty((0, TOTAL_SHARDS), dtype=np.int64)
        group, rotation = self._group_and_rotation(keys)
        slots = (rotation[:, None] + np.arange(TOTAL_SHARDS)[None, :]) % TOTAL_SHARDS
        return self.groups[group[:, None], slots]

    def _group_and_rotation(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        h = key_prefixes(keys)
        groups = np.uint64(len(self.groups))
        return (h % groups).astype(np.int64), ((h // groups) % np.uint64(TOTAL_SHARDS)).astype(np.int64)

    def primaries(self, keys: Sequence[bytes]) -> np.ndarray:
        """Node id of each key's primary (the holder of data shard 0 and the block record)."""
        if not keys:
            return np.empty(0, dtype=np.int64)
        group, rotation = self._group_and_rotation(keys)
        return self.groups[group, rotation]


def key_prefixes(keys: Sequence[bytes]) -> np.ndarray:
    """The first 8 bytes of every key as little-endian uint64 (keys must be of equal length >= 8)."""
    width = len(keys[0])
    blob = b"".join(keys)
    if len(blob) != width * len(keys) or width < 8:
        raise ValueError("keys in one batch must all have the same length (at least 8 bytes)")
    return np.frombuffer(blob, dtype=np.uint8).reshape(len(keys), width)[:, :8].copy().view("<u8").ravel()


def primary_budget_bytes(groups: Sequence[Sequence[int]], capacities: Mapping[int, int], node_id: int) -> int:
    """What the blocks one primary holds may take on every node of its group (in slots of one shard).

    A node that fills ``m`` of the group's 12 slots holds ``m`` shards, of one size, of every block of the
    group, and primaries spread evenly over the group's ``n`` distinct nodes; so with every primary within
    ``smallest capacity / (n × largest m)`` no node of the group passes its capacity (``capacity / 12`` for a
    group of 12 distinct nodes).
    """
    group = list(next(g for g in groups if node_id in g))
    nodes = set(group)
    most = max(group.count(nid) for nid in nodes)
    return min(capacities[nid] for nid in nodes) // (len(nodes) * most)
