"""Which leading blocks of a running ``get_into`` are already in place, for another thread to act on while the rest
is read (the engine copies them to the GPU: the copies then run beside the read instead of after it).

A block is *settled* once each of its 10 data shards is whole in the block's buffer and its bytes matched the crc32c
its node stored. Nothing writes into a settled block's buffer any more: a shard is received once (a request resent
after a lost connection lands the same bytes again), a degraded read rebuilds only blocks short of a valid data
shard, and nothing else writes into the caller's buffers. A settled block may still be a miss (its primary answered
that it is absent, or under another header): whether a block was read is ``get_into``'s answer, as ever.

How it is known without slowing the read: the receiving threads stay in compiled code and only store each reply's
landed byte count into a cell (``ReceivePlan.progress``); a reply's shards land in its payload order, each
checksummed as it lands. The asking thread does the rest (:meth:`ReadWatch.settled`): per reply under way, the
shards whose last byte is below its count and whose crc32c matches, and the replies already complete; a lane's
settled prefix is the leading run of blocks with all 10 data shards so. It costs the asker ~5 us a reply under
way and the readers nothing beyond one store per receive.

Contract: ``settled()`` may be called from any thread at any time (while the read runs, or after); each lane's
prefix only grows; a lane shows up once it has started. Blocks of a lane past its settled prefix are told by
``get_into``'s ``on_landed`` when the lane ends, as without a watch.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from kvtier.kvstore.codec import DATA_SHARDS


class Landing(NamedTuple):
    """The shards a GET reply's payload brings: (block, shard) ``shards`` whose bytes land where they are
    used, with the crc32c each accumulates as it arrives and the one its node stored (None: a node that
    checks the shards itself)."""

    shards: np.ndarray
    crcs: np.ndarray | None
    expected: np.ndarray | None
    ends: np.ndarray | None = None  # watched reads: the payload offset each shard is whole at
    progress: np.ndarray | None = None  # watched reads: the payload bytes landed so far (stored by the receive)


class WatchedRead(Protocol):
    """What a lane's watch reads of the read it watches (``reads.ReadState``)."""

    valid: np.ndarray  # (block, shard): the shard is in place and its crc32c matched
    receiving: dict[int, Landing]  # request id -> the shards its payload brings, while it lands
    watched: bool  # set by the watch: the read's replies report their progress


class LaneWatch:
    """One lane of a watched read: blocks ``lo..`` of the call, read by one ``reads.ReadState``."""

    __slots__ = ("_prefix", "_seen", "_state", "_whole", "lo")

    def __init__(self, lo: int) -> None:
        self.lo = lo
        self._state: WatchedRead | None = None
        self._whole = np.zeros((0, DATA_SHARDS), dtype=bool)  # data shards known in place, per block of the lane
        self._seen: dict[int, tuple[int, int]] = {}  # request id -> (its progress, its leading shards counted then)
        self._prefix = 0

    def attach(self, state: WatchedRead) -> None:
        """The lane's read starts with ``state`` (its first; a later read of moved blocks is not watched)."""
        if self._state is None:
            state.watched = True
            self._whole = np.zeros((len(state.valid), DATA_SHARDS), dtype=bool)
            self._state = state

    def settled(self) -> int:
        """How many leading blocks of the lane are settled (see the module docstring)."""
        state = self._state
        if state is None or self._prefix == len(self._whole):
            return self._prefix
        whole = self._whole
        np.logical_or(whole, state.valid[:, :DATA_SHARDS], out=whole)  # replies complete
        for request_id, landing in list(state.receiving.items()):  # replies under way
            if landing.progress is None or landing.crcs is None or landing.expected is None:
                continue
            progress = int(landing.progress[0])
            before, seen = self._seen.get(request_id, (0, 0))
            if progress == before:  # nothing new landed: no numpy call
                continue
            whole_shards = int(np.searchsorted(landing.ends, progress, side="right"))
            self._seen[request_id] = (progress, whole_shards)
            if whole_shards <= seen:
                continue
            new, at = landing.shards[seen:whole_shards], slice(seen, whole_shards)
            good = new[(landing.crcs[at] == landing.expected[at]) & (new[:, 1] < DATA_SHARDS)]
            whole[good[:, 0], good[:, 1]] = True
        ready = whole.all(axis=1)
        self._prefix = len(ready) if ready.all() else int(ready.argmin())
        return self._prefix


class ReadWatch:
    """Handed to ``get_into(watch=)``; asked from another thread which blocks have settled."""

    def __init__(self) -> None:
        self._lanes: list[LaneWatch] = []

    def lane(self, lo: int) -> LaneWatch:
        """The watch of a lane reading blocks ``lo..`` (called by the read as each lane starts)."""
        lane = LaneWatch(lo)
        self._lanes.append(lane)
        return lane

    def settled(self) -> list[tuple[int, int]]:
        """Per lane started so far: (first block, end of its settled prefix), in the call's block numbers."""
        return [(lane.lo, lane.lo + lane.settled()) for lane in list(self._lanes)]
