"""Which blocks of a peer's placement groups a node holds shards of: what a node rebuilding after its data was
lost asks its peers (admin ``blocks_held``; docs/design.md §6).

A node whose data dir is new (a replacement, or a disk wiped after a failure) holds nothing, and nothing it
holds says what it should hold. Every block has a shard on every node of its group, so the blocks it should
hold are those its peers hold shards of: each peer answers from its in-memory shard index, whatever records
it keeps or lost. That also finds blocks no record anywhere names any more (written before records were kept
on three nodes, or three holders lost at once): they are rebuilt from their shards, or reclaimed when fewer
than ten are left.

Pages: keys are random hashes, so a page is a range of their first 8 bytes (little-endian, as placement reads
them): ``start`` onwards, at most about ``limit`` blocks, and ``next`` to ask for the rest (None: done). A page
costs a few passes over the node's shard names (no sort of them all): about 30 ms for a million shards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvtier.kvstore.placement import Placement

_SLASH = ord("/")


def blocks_held(
    tables: Iterable[tuple[np.ndarray, np.ndarray]],
    placement: Placement,
    node_id: int,
    start: int,
    limit: int,
    before: float = math.inf,
) -> dict[str, Any]:
    """One page of the blocks that ``tables`` (a node's shard names and records, ``ChunkEngine.shard_tables``)
    hold a shard of, committed ``before`` that time, and that have a shard at ``node_id``, each once:
    ``{"groups": [{"tenant", "klen", "keys", "created"}], "next"}``, keys concatenated, ``created`` the shard's
    commit time (``<f8`` each), ``next`` the ``start`` of the next page or None."""
    found = []  # per (tenant, key length): tenant, key table, created, first 8 bytes of each key
    for names, records in tables:
        if not len(names):
            continue
        slash = (names == _SLASH).argmax(axis=1)  # tenant names hold no "/"
        old = records["created"] < before
        for cut in np.unique(slash).tolist():
            rows = np.flatnonzero((slash == cut) & old)
            if not len(rows):
                continue
            keys = names[rows, cut + 1 : -1]
            h = np.ascontiguousarray(keys[:, :8]).view("<u8").ravel()
            mine = (h >= np.uint64(start)) & placement.in_groups_of(node_id, h)
            tenant = names[rows[0], :cut].tobytes().decode()
            found.append((tenant, keys[mine], records["created"][rows[mine]], h[mine]))
    every = np.concatenate([h for *_, h in found]) if found else np.zeros(0, dtype="<u8")
    page_end = None
    if len(every) > limit:
        page_end = int(np.partition(every, limit)[limit])  # the next page starts here (keys sharing it too)
        if not (every < np.uint64(page_end)).any():  # a page of keys that all share their first 8 bytes
            later = every[every > np.uint64(page_end)]
            page_end = int(later.min()) if len(later) else None
    groups = []
    for tenant, keys, created, h in found:
        inside = h < np.uint64(page_end) if page_end is not None else np.ones(len(h), dtype=bool)
        if not inside.any():
            continue
        # a node may hold several shards of a block (a group listing it twice): each block once
        unique, first = np.unique(keys[inside], axis=0, return_index=True)
        groups.append(
            {
                "tenant": tenant,
                "klen": keys.shape[1],
                "keys": unique.tobytes(),
                "created": created[inside][first].astype("<f8").tobytes(),
            }
        )
    return {"groups": groups, "next": page_end}
