"""Restoring full redundancy: the per-node repairer of the GC (docs/design.md §6, "Repair").

Every block is written 10+2 and commits with at least ``min_write_shards`` of its 12 shards; shards go
missing with a node's disk, to bit rot (the scrubber finds it) or were never written (a node down during the
put). The holders of shards 0, 1 and 2 keep the block's record, so any two lost nodes leave one. Where the
work comes from:

1. **Owed repairs** (``kvstore.node.owed``): a primary that commits a block short of shards owes its repair; so
   does a node whose repair could not finish (a holder was down). ``work_off`` runs every ``gc.interval_s``
   on the background thread (``run``), oldest first, and backs off while nothing can be finished.
2. **Rebuild**: a node whose data dir is new (a replacement, or a wiped disk) asks every peer of its placement
   groups which blocks older than the data dir they hold shards of (admin ``blocks_held``: the shards' own
   records, whatever block records survived; later blocks were written with this node up), until all peers
   but at most two have answered; ``kvctl repair --rebuild`` asks again, for all blocks. It takes on each
   block that lost its shard here when it is the first holder (by shard index) that lost one, so two wiped
   nodes do not both repair it.
3. **Full pass** (``kvctl repair``): every block whose record is held here, taken on by the first holder of
   shards 0, 1, 2 that still has its record (with ``--rebuild``, then a rebuild).
4. **Scrub**: a shard here whose bytes fail their crc32c (``repair_corrupt``).

What a repair does with a block, after one survey of its 12 holders (shards stored, records kept; metadata
only):

| records at holders of shards 0-2 | shards | action |
|---|---|---|
| one is being removed (intent) | any | nothing: it is going away |
| none, every holder answered | any | gone (never brought back), unless a rebuild found it (*orphan*) |
| none answered, some holders down | any | wait |
| held, or orphan | 12 | done |
| held, or orphan | ≥ 10 | decode, rewrite the lost shards (records too) where holders answered; else wait |
| held, or orphan | < 10 even with every down holder back | reclaim: records and shards removed everywhere * |
| held, or orphan | otherwise | wait (owed) |

An orphan (no record anywhere: written before records were kept on three nodes, or three holders lost) is
rebuilt, and a block is reclaimed (*), only once it is older than ``gc.write_timeout_s``: a put whose COMMIT
has reached some holders and not others looks like a block that lost shards (or its records) meanwhile.
Repair moves at most ``gc.repair_bytes_per_s``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvtier.gc.evictor import Evictor
from kvtier.gc.stats import GCStats
from kvtier.kvstore.client import Client
from kvtier.kvstore.client.core import UNKNOWN, Survey
from kvtier.kvstore.cluster.config import ClusterConfig
from kvtier.kvstore.codec import DATA_SHARDS, TOTAL_SHARDS
from kvtier.kvstore.node.chunks import ChunkEngine
from kvtier.kvstore.node.disk import NoSpace
from kvtier.kvstore.node.owed import CORRUPT, ORPHAN, Owed
from kvtier.kvstore.placement import Placement
from kvtier.kvstore.wire.fields import RecordState

log = logging.getLogger("kvtier.gc")

SURVEY_BATCH = 512  # blocks surveyed per round (metadata only)
READ_BATCH = 64  # blocks decoded and rewritten at a time
OWED_PER_PASS = 4096  # owed repairs looked at per background pass
MAX_BACKOFF_S = 30.0
Progress = Callable[[int, int, int], None]  # blocks checked, of how many, shards rewritten so far


class Rule(enum.Enum):
    """Which of the nodes that know of a block acts on it, so that a block is repaired once."""

    ALWAYS = "always"  # this node owes it (owed list, scrub)
    FIRST_RECORD = "first record"  # the first holder of shards 0, 1, 2 that has the record (full pass)
    FIRST_LOST = "first lost"  # the first holder whose shard is lost, if that is here (rebuild)


class Action(enum.IntEnum):
    SKIP = 0  # another node acts on it
    DONE = 1  # all 12 shards stored
    GONE = 2  # removed, or being removed: nothing to do, ever
    REWRITE = 3  # read it, rewrite its lost shards
    RECLAIM = 4  # unrecoverable: remove it everywhere
    WAIT = 5  # cannot be finished now (holders down, or an orphan too young to judge)


class Candidate(NamedTuple):
    """A block to look at: its key, its creation time (a rewritten record or shard keeps it), whether it was
    found by a rebuild (may be an orphan), and shards known to be bad (a bit each; those held here are
    rewritten even though they are there: the scrubber found their bytes corrupt)."""

    key: bytes
    created: float
    orphan: bool = False
    bad: int = 0


def plan(survey: Survey, here: np.ndarray, rule: Rule, orphan: np.ndarray, old_enough: np.ndarray) -> np.ndarray:
    """Per block, the ``Action`` of the table in the module docstring. ``here`` (n × 12): which shards of each
    block this node holds by the placement; ``orphan``: found by a rebuild; ``old_enough``: created longer than
    ``write_timeout_s`` ago (a younger block may still be committing: its shards pending on some holders look
    lost, so it is neither reclaimed nor taken for an orphan). ``survey.present`` must already count as lost a
    shard known to be bad."""
    present, answered, records = survey.present, survey.answered, survey.records
    n = len(present)
    stored = present.sum(axis=1)
    down = (~answered).sum(axis=1)
    removing = (records == RecordState.REMOVING).any(axis=1)
    held = records == RecordState.HELD
    recorded = held.any(axis=1)
    every_holder_answered = (records != UNKNOWN).all(axis=1)
    as_orphan = ~recorded & every_holder_answered & orphan & old_enough
    live = (recorded | as_orphan) & ~removing
    lost = answered & ~present
    if rule is Rule.FIRST_RECORD:  # act where no lower holder of shards 0-2 has the record
        first = held.argmax(axis=1)
        mine = recorded & here[np.arange(n), first]
    elif rule is Rule.FIRST_LOST:  # act where the first lost shard is here
        first = lost.argmax(axis=1)
        mine = lost.any(axis=1) & here[np.arange(n), first]
    else:
        mine = np.ones(n, dtype=bool)
    action = np.full(n, Action.WAIT, dtype=np.uint8)
    action[live & (stored + down < DATA_SHARDS) & old_enough] = Action.RECLAIM
    action[live & (stored >= DATA_SHARDS) & lost.any(axis=1)] = Action.REWRITE  # else only down holders lack it
    action[live & (stored == TOTAL_SHARDS)] = Action.DONE
    action[removing | (~recorded & every_holder_answered & ~orphan)] = Action.GONE
    action[~mine & (action != Action.GONE)] = Action.SKIP
    return action


class Repairer:
    """Takes on and carries out repairs for one node (see the module docstring). Thread-safe: one repair runs at a
    time (the background loop, ``kvctl repair``, the scrubber's)."""

    def __init__(
        self,
        engine: ChunkEngine,
        node_id: int,
        config: ClusterConfig,
        evictor: Evictor,
        stats: GCStats,
        clock: Callable[[], float] = time.time,
        on_restored: Callable[[float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.node_id = node_id
        self.config = config
        self.evictor = evictor
        self.clock = clock
        self.on_restored = on_restored  # seconds from when a repair was owed to when the block had 12 shards
        self.client = Client(config)  # the cluster token: acts for each tenant in turn; used under the lock
        self.stats = stats
        self._lock = threading.Lock()
        self._next_rate_check = time.monotonic()

    @property
    def placement(self) -> Placement:
        """Where blocks are now: the client's placement (with an etcd map, the newest map it has)."""
        return self.client.placement

    @property
    def peers(self) -> list[int]:
        """The other nodes of this node's placement groups, in the newest map the client has."""
        groups = self.placement.groups.tolist()
        return sorted({n for g in groups if self.node_id in g for n in g} - {self.node_id})

    # -- the background loop --------------------------------------------------------------------------

    def run(self, stopping: threading.Event) -> None:
        """Every ``gc.interval_s``: finish a rebuild not done yet, then work off owed repairs; while a pass
        finishes nothing (holders down), wait ever longer, up to 30 s. Failures are logged and retried."""
        wait = self.config.gc.interval_s
        while not stopping.wait(wait):
            try:
                since = self.engine.rebuild_pending()
                progress = self.rebuild(before=since) if since is not None else False
                progress = self.work_off() or progress
            except NoSpace:  # (counted, and logged once, by the engine) retried next time
                progress = False
            except Exception:
                log.exception("repair pass failed")
                progress = False
            owed, _ = self.engine.owed_summary()
            calm = progress or not owed
            wait = self.config.gc.interval_s if calm else min(MAX_BACKOFF_S, 2 * wait)

    def work_off(self) -> bool:
        """One pass over the oldest owed repairs; returns whether any was settled."""
        entries = self.engine.owed_repairs(OWED_PER_PASS)
        if not entries:
            return False
        settled = 0
        with self._lock:
            by_tenant: dict[str, list[tuple[Owed, Candidate]]] = {}
            records = self.engine.block_records([entry.bkey for entry in entries])
            for entry in entries:
                record = records.get(entry.bkey)
                created = record.created if record is not None else entry.created
                tenant, key = _split(entry.bkey)
                bad = entry.missing if entry.flags & CORRUPT else 0
                candidate = Candidate(key, created, bool(entry.flags & ORPHAN), bad)
                by_tenant.setdefault(tenant, []).append((entry, candidate))
            for tenant, items in by_tenant.items():
                actions = self._repair(tenant, [c for _, c in items], Rule.ALWAYS, owe=False)
                settled += sum(a in _FINAL for a in actions)
        return settled > 0

    def _settle(self, prefix: bytes, keys: Sequence[bytes], actions: np.ndarray) -> None:
        """Blocks a repair finished (12 shards, or gone) are owed no more, whichever pass found it: a fill's or
        ``kvctl repair``'s leaves no owed entry to wait for the owed list's next turn (up to ``MAX_BACKOFF_S``) while
        ``blocks_under_replicated`` counts them. Their time to redundancy is observed."""
        final = np.isin(actions, _FINAL)
        if not final.any():
            return
        since = self.engine.settle_owed([prefix + keys[b] for b in np.flatnonzero(final).tolist()])
        if self.on_restored is not None and since:
            now = self.clock()
            for b in np.flatnonzero(actions == Action.DONE).tolist():
                if (when := since.get(prefix + keys[b])) is not None:
                    self.on_restored(now - when)

    # -- full pass, rebuild, scrub ----------------------------------------------------------------------

    def full_pass(self, rebuild: bool = False, progress: Progress | None = None) -> None:
        """``kvctl repair``: every block whose record is held here (acted on by the first holder of shards 0-2
        still keeping it); with ``rebuild`` (``kvctl repair --rebuild``) then a rebuild from every block the
        peers hold shards of (it scans every peer's shard index: for blocks no record names any more).
        ``progress`` is told after each batch: blocks checked, of how many, shards rewritten so far."""
        with self._lock:
            self._reach_peers()
            by_tenant: dict[str, list[Candidate]] = {}
            for bkey, record in self.engine.records_held():
                tenant, key = _split(bkey)
                by_tenant.setdefault(tenant, []).append(Candidate(key, record.created))
            total, checked, repaired = sum(map(len, by_tenant.values())), 0, self.stats.shards_repaired
            if progress is not None:
                progress(0, total, 0)
            for tenant, candidates in by_tenant.items():
                for start in range(0, len(candidates), SURVEY_BATCH):
                    batch = candidates[start : start + SURVEY_BATCH]
                    self._repair(tenant, batch, Rule.FIRST_RECORD, owe=True)
                    checked += len(batch)
                    if progress is not None:
                        progress(checked, total, self.stats.shards_repaired - repaired)
        if rebuild:
            self.rebuild()

    def rebuild(self, before: float | None = None) -> bool:
        """Ask every peer which blocks of this node's groups it holds shards of (committed ``before`` then, if
        given: a data dir's rebuild looks only at blocks older than the data dir; later ones were written with
        this node up, and a primary owes any shard it missed), and take on those that lost their shard here
        (see the module docstring). Complete when all peers but at most two answered: a pending rebuild of the
        data dir is done then. Returns whether it completed."""
        found: dict[str, dict[bytes, float]] = {}
        silent = 0
        with self._lock:
            self._reach_peers()
            for peer in self.peers:
                held = self.client.blocks_held(peer, self.node_id, before)
                if held is None:
                    silent += 1
                    continue
                for tenant, blocks in held.items():
                    mine = found.setdefault(tenant, {})
                    for key, created in blocks.items():
                        mine[key] = min(created, mine.get(key, created))
            for tenant, blocks in found.items():
                candidates = [Candidate(key, created, orphan=True) for key, created in blocks.items()]
                self._repair(tenant, candidates, Rule.FIRST_LOST, owe=True)
        # a block that can be read has shards on all but two of the other nodes of its group: two peers that
        # did not answer hide none of them (only leftovers of unreadable ones, which a later rebuild finds)
        complete = silent <= 2
        if complete and before is not None:
            self.engine.rebuilt()
            looked_at = sum(map(len, found.values()))
            log.info("rebuild from %d peers complete: %d blocks looked at", len(self.peers), looked_at)
        return complete

    def repair_corrupt(self, tenant: str, items: Sequence[tuple[bytes, int, float]]) -> int:
        """Rewrite shards held here whose bytes failed their crc32c (the scrubber's finding): (key, shard index,
        the shard's creation time) each; a bad shard of a block that is gone is dropped. Returns how many were
        rewritten now (the others are owed)."""
        with self._lock:
            candidates = [Candidate(key, created, bad=1 << index) for key, index, created in items]
            actions = self._repair(tenant, candidates, Rule.ALWAYS, owe=True)
        gone = [(key, index) for (key, index, _), a in zip(items, actions, strict=True) if a == Action.GONE]
        if gone:
            self.engine.drop_shards(tenant, gone)
        return sum(a == Action.DONE for a in actions)

    def _reach_peers(self) -> None:
        """With the lock held: connect now to every node of this node's groups that the client's pool holds
        for down (a peer that restarted a moment ago is otherwise skipped for ``retry_down_after_s``, and a
        pass run now would leave its shards owed)."""
        for node_id in (*self.peers, self.node_id):
            self.client.pool.get(node_id, retry_now=True)

    # -- one repair ------------------------------------------------------------------------------------

    def _repair(self, tenant: str, candidates: Sequence[Candidate], rule: Rule, owe: bool) -> list[Action]:
        """Survey ``candidates`` (blocks of ``tenant``), act on each as ``plan`` says, and, when ``owe``, take
        on the ones left waiting (the owed list). Returns each block's action. With the lock held."""
        actions: list[Action] = []
        with self.client.acting_for(tenant):
            for start in range(0, len(candidates), SURVEY_BATCH):
                batch = candidates[start : start + SURVEY_BATCH]
                actions += self._repair_batch(tenant, batch, rule, owe)
        return actions

    def _repair_batch(self, tenant: str, batch: Sequence[Candidate], rule: Rule, owe: bool) -> list[Action]:
        keys = [c.key for c in batch]
        survey = self.client.survey(keys)
        here = self.placement.shard_nodes(keys) == self.node_id
        bad = np.asarray([c.bad for c in batch], dtype=np.uint16)[:, None] >> _SHARD_BITS & 1
        survey.present[(bad == 1) & here] = False  # known corrupt here: stored, but as good as lost
        created = np.asarray([c.created for c in batch], dtype=np.float64)
        old_enough = created < self.clock() - self.config.gc.write_timeout_s
        orphan = np.asarray([c.orphan for c in batch], dtype=bool)
        action = plan(survey, here, rule, orphan, old_enough)
        rewrite = np.flatnonzero(action == Action.REWRITE)
        for lo in range(0, len(rewrite), READ_BATCH):
            rows = rewrite[lo : lo + READ_BATCH]
            finished = self._rewrite([batch[b] for b in rows.tolist()], survey.present[rows], survey.answered[rows])
            action[rows[finished]] = Action.DONE
            action[rows[~finished]] = Action.WAIT
        reclaim = np.flatnonzero(action == Action.RECLAIM)
        if len(reclaim):
            self._reclaim(tenant, [batch[b] for b in reclaim.tolist()], survey.records[reclaim])
        prefix = tenant.encode() + b"/"
        self._settle(prefix, keys, action)
        if owe:
            waiting = np.flatnonzero(action == Action.WAIT).tolist()
            missing = (~survey.present).astype(np.uint16) << _SHARD_BITS
            masks = missing.sum(axis=1, dtype=np.uint16).tolist()
            now = self.clock()
            flags = [(ORPHAN if c.orphan else 0) | (CORRUPT if c.bad else 0) for c in batch]
            self.engine.owe([Owed(prefix + keys[b], now, masks[b], flags[b], batch[b].created) for b in waiting])
        return [Action(a) for a in action.tolist()]

    def _rewrite(self, blocks: Sequence[Candidate], present: np.ndarray, answered: np.ndarray) -> np.ndarray:
        """Read ``blocks`` (decoded from any 10 shards) and rewrite their shards not ``present`` (n × 12) whose
        holders ``answered``, records included where a shard 0, 1 or 2 is rewritten; per block whether it has
        all 12 shards again."""
        lost = answered & ~present
        keys = [c.key for c in blocks]
        decoded = self.client.read_for_repair(keys)
        finished = np.zeros(len(blocks), dtype=bool)
        by_class: dict[str, list[int]] = {}
        for j, found in enumerate(decoded):
            if found is not None and found.ttl_class is not None:
                by_class.setdefault(found.ttl_class, []).append(j)
        moved = 0
        written = 0
        for ttl_class, rows in by_class.items():
            got = [decoded[j] for j in rows]
            stored = self.client.write_shards(
                [keys[j] for j in rows],
                [d.data for d in got],  # type: ignore[union-attr]
                ttl_class,
                lost[rows],
                [d.header for d in got],  # type: ignore[union-attr]
                created=[blocks[j].created for j in rows],
            )
            written += int((stored & lost[rows]).sum())
            finished[rows] = (stored | present[rows]).all(axis=1)
            moved += sum(len(d.data) for d in got)  # type: ignore[union-attr]
        self.stats.blocks_repaired += int(finished.sum())
        self.stats.shards_repaired += written
        self.stats.repair_bytes += moved
        self._pace(moved)
        return finished

    def _reclaim(self, tenant: str, blocks: Sequence[Candidate], records: np.ndarray) -> None:
        """Remove unrecoverable blocks everywhere: records and every shard left, so they hold no space until their
        TTL. Where this node is the primary and keeps the record, as an eviction (an intent, DELETEs resent
        until every holder answered); otherwise by a DELETE to every holder, sparing shards written since (a
        re-put), and for orphans shards committed within ``write_timeout_s``."""
        keys = [c.key for c in blocks]
        primary = self.placement.primaries(keys) == self.node_id
        own = primary & (records[:, 0] == RecordState.HELD)
        prefix = tenant.encode() + b"/"
        if own.any():
            self.evictor.remove(lambda: [prefix + k for k, mine in zip(keys, own.tolist(), strict=True) if mine])
        orphans = (records != RecordState.HELD).all(axis=1)
        for which, before in (
            (~own & ~orphans, self.clock()),
            (~own & orphans, self.clock() - self.config.gc.write_timeout_s),
        ):
            if which.any():
                self.client.delete([k for k, w in zip(keys, which.tolist(), strict=True) if w], before=before)
        log.warning("%d blocks of tenant %s lost more than 2 shards: removed everywhere", len(keys), tenant)
        self.stats.blocks_reclaimed += len(keys)

    def _pace(self, moved: int) -> None:
        """Keep repair under ``repair_bytes_per_s``: sleep until ``moved`` more bytes are within the rate."""
        now = time.monotonic()
        self._next_rate_check = max(self._next_rate_check, now) + moved / self.config.gc.repair_bytes_per_s
        time.sleep(max(0.0, self._next_rate_check - now))

    def close(self) -> None:
        self.client.close()


_FINAL = (Action.DONE, Action.GONE, Action.RECLAIM)
_SHARD_BITS = np.arange(TOTAL_SHARDS, dtype=np.uint16)


def _split(bkey: bytes) -> tuple[str, bytes]:
    cut = bkey.index(b"/")
    return bkey[:cut].decode(), bkey[cut + 1 :]
