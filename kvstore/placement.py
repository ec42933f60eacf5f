"""Placement: which nodes hold which shards of a block, computed for whole batches at once.

A block belongs to placement group ``jump(h, G)`` (``h`` = the key's first 8 bytes, little-endian; ``jump`` is
Lamping and Veach's jump consistent hash, so adding a group moves only the ``1/(G+1)`` of blocks the new group
takes, and no block between old groups) and its shards rotate over the group's 12 slots by ``h mod 12``: shard
``i`` lives in slot ``(i + rot) mod 12``. Parity shards and primaries (the holder of data shard 0, which also
keeps the block record) therefore spread evenly over a group's nodes. The holders of shards 1 and 2 keep copies of
the record (``RECORD_HOLDERS``). Everything is numpy so that planning a
1,200-key batch costs microseconds, not a Python loop per key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvtier.kvstore import _native
from kvtier.kvstore.codec import TOTAL_SHARDS

RECORD_HOLDERS = 3
"""The holders of shards 0 (the primary), 1 and 2 keep the block record: any two lost nodes leave one, from which
repair rebuilds the others (docs/design.md §3)."""


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

    def in_groups_of(self, node_id: int, h: np.ndarray) -> np.ndarray:
        """Per key prefix ``h`` (the first 8 bytes, ``<u8``) whether its block's group has ``node_id`` in a slot."""
        holding = (self.groups == node_id).any(axis=1)
        return holding[jump_hash(h, len(self.groups))]

    def _group_and_rotation(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        h = key_prefixes(keys)
        return jump_hash(h, len(self.groups)), (h % np.uint64(TOTAL_SHARDS)).astype(np.int64)

    def primary_runs(self, blob: bytes, klen: int) -> tuple[np.ndarray, list[tuple[int, int, int]], bytes]:
        """The keys of ``blob`` (``klen`` bytes each, concatenated) sorted by primary, in one compiled pass: the order
        (key indexes, stable), each primary's run of it as (node, lo, hi) ascending, and the keys in that order."""
        order, runs, rows = _native.primary_runs(blob, klen, self.groups, TOTAL_SHARDS)
        return np.frombuffer(order, dtype=np.int64), runs, rows

    def primaries(self, keys: Sequence[bytes]) -> np.ndarray:
        """Node id of each key's primary (the holder of data shard 0 and the block record)."""
        if not len(keys):
            return np.empty(0, dtype=np.int64)
        group, rotation = self._group_and_rotation(keys)
        return self.groups[group, rotation]


def jump_hash(h: np.ndarray, buckets: int) -> np.ndarray:
    """Jump consistent hash (Lamping and Veach, 2014) of every uint64 in ``h`` into ``range(buckets)``: growing
    ``buckets`` by one moves a key only into the new bucket. Compiled (``_native.jump_hash``): the paper's loop."""
    out = np.empty(len(h), dtype=np.int64)
    _native.jump_hash(np.ascontiguousarray(h, dtype=np.uint64), max(1, buckets), out)
    return out


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
