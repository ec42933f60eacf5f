"""What a cluster holds, in blocks of one size, as its nodes enforce it: the capacity trace replay plans with.

The obvious figure, ``nodes × node bytes / block bytes``, is 1.3–1.5× too high, for three reasons the nodes'
own code decides (imported here, never restated):

1. **Erasure coding.** A block of ``B`` bytes becomes 12 shards (10 data + 2 parity) of ``shard_size(B)``
   (``codec.shard_size``): 1.2× its bytes.
2. **Slot rounding.** A shard takes a slab slot of the smallest size class that holds it
   (``slabs.size_class_for``, quarter-power steps): up to ~20 % more.
3. **Per-primary budgets.** Each primary's blocks may take ``placement.primary_budget_bytes`` on every node of its
   group (node capacity / 12 for a group of 12 distinct nodes), so a primary holds ``budget // slot`` blocks; its
   GC keeps them between the ``[gc]`` watermarks of that budget.

:class:`Capacity` is that figure per primary; ``tools.replay`` replays a trace against it (one LRU over the sum,
or one LRU per primary, with keys placed as the client places them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.kvstore.cluster.config import ClusterConfig, GCConfig
from kvtier.kvstore.codec import TOTAL_SHARDS, shard_size
from kvtier.kvstore.node.slabs import SIZE_CLASSES, size_class_for
from kvtier.kvstore.placement import Placement, primary_budget_bytes

DEFAULT_WATERMARKS = (GCConfig.high_watermark, GCConfig.low_watermark)  # what `kvstore init` writes


@dataclass(frozen=True)
class Capacity:
    """The blocks of ``block_bytes`` a cluster holds: ``primaries[node id]`` blocks per primary, kept between
    ``watermarks`` (high, low) of each; ``groups`` place keys (``Placement``)."""

    block_bytes: int
    shard_bytes: int
    slot_bytes: int
    primaries: dict[int, int]
    watermarks: tuple[float, float]
    groups: tuple[tuple[int, ...], ...]

    @property
    def blocks(self) -> int:
        """Blocks the whole cluster holds at 100 % of every budget."""
        return sum(self.primaries.values())

    def primary_index(self, hash_ids: Sequence[int], salt: bytes = b"") -> np.ndarray:
        """For trace hash ids, the index into ``sorted(primaries)`` of the primary each one's block has when its
        key is :func:`block_key` of ``salt`` (as ``replay_live`` stores it), placed by ``Placement``."""
        nodes = Placement(self.groups).primaries([block_key(h, salt) for h in hash_ids])
        return np.searchsorted(np.array(sorted(self.primaries)), nodes)

    def to_dict(self) -> dict[str, Any]:
        per = list(self.primaries.values())
        return {
            "block_bytes": self.block_bytes,
            "shard_bytes": self.shard_bytes,
            "slot_bytes": self.slot_bytes,
            "primaries": len(per),
            "blocks_per_primary": [min(per), max(per)],
            "capacity_blocks": self.blocks,
            "watermarks": list(self.watermarks),
        }


def block_key(hash_id: int, salt: bytes = b"") -> bytes:
    """The 16-byte store key of a trace block: ``blake2b(salt ‖ hash id)`` (a fresh salt per live run keeps runs
    from hitting each other's blocks; the same salt places blocks on the same primaries)."""
    return hashlib.blake2b(salt + hash_id.to_bytes(8, "little", signed=True), digest_size=16).digest()


def capacity(
    groups: Sequence[Sequence[int]],
    capacities: Mapping[int, int],
    block_bytes: int,
    watermarks: tuple[float, float] = DEFAULT_WATERMARKS,
) -> Capacity:
    """The capacity of placement ``groups`` over nodes of ``capacities`` (bytes) for blocks of ``block_bytes``.
    Raises ValueError for a block no slot holds or a non-positive size."""
    if block_bytes <= 0:
        raise ValueError(f"block size must be positive, got {block_bytes}")
    shard = shard_size(block_bytes)
    slot = SIZE_CLASSES[size_class_for(shard)]
    nodes = sorted({n for group in groups for n in group})
    primaries = {n: primary_budget_bytes(groups, capacities, n) // slot for n in nodes}
    return Capacity(block_bytes, shard, slot, primaries, watermarks, tuple(tuple(g) for g in groups))


def cluster_capacity(config: ClusterConfig, block_bytes: int) -> Capacity:
    """A cluster file's capacity: its nodes, groups and ``[gc]`` watermarks."""
    capacities = {nid: node.capacity_bytes for nid, node in config.nodes.items()}
    watermarks = (config.gc.high_watermark, config.gc.low_watermark)
    return capacity(config.groups, capacities, block_bytes, watermarks)


def local_capacity(node_capacity_bytes: int, block_bytes: int, nodes: int = TOTAL_SHARDS) -> Capacity:
    """The capacity of the cluster ``kvstore init --nodes N --capacity SIZE`` writes (groups of 12 in order,
    default watermarks). Raises ValueError unless ``nodes`` is a positive multiple of 12."""
    if nodes <= 0 or nodes % TOTAL_SHARDS:
        raise ValueError(f"nodes must be a positive multiple of {TOTAL_SHARDS}, got {nodes}")
    groups = [list(range(g, g + TOTAL_SHARDS)) for g in range(0, nodes, TOTAL_SHARDS)]
    return capacity(groups, dict.fromkeys(range(nodes), node_capacity_bytes), block_bytes)
