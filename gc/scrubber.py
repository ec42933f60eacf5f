"""The scrubber: every committed shard's bytes checked against their crc32c, and what fails rewritten.

A shard that rots where nobody reads it would otherwise stay bad until a read happens to need it, and a
second loss in its block would then cost the block. The scrubber reads this node's shards in slot order (the
slab files front to back; ``ChunkEngine.scrub``) and checks each one's crc32c, pinned while it is read. A
pass covers every shard once per ``gc.scrub_period_s``, paced to what that needs and never faster than
``gc.scrub_bytes_per_s``; where it got to is kept in the data dir's settings, so a restart goes on from there.
Shards that fail are handed to the repairer (``Repairer.repair_corrupt``): the block is decoded from its other
shards and the bad one rewritten here. ``kvctl scrub`` runs a whole pass at once (``scrub_now``) and reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.gc.repairer import Repairer
from kvtier.gc.stats import GCStats
from kvtier.kvstore.cluster.config import ClusterConfig
from kvtier.kvstore.node.chunks import SCRUB_AT, ChunkEngine
from kvtier.kvstore.node.disk import NoSpace

log = logging.getLogger("kvtier.gc")

POSITION = SCRUB_AT  # setting: the place (size class, slot) the running pass has checked up to
STEP_BYTES = 8 << 20  # checked per step (then the pace decides how long to wait)


class Scrubber:
    """See the module docstring. Thread-safe: the background loop and ``scrub_now`` may run at once."""

    def __init__(
        self,
        engine: ChunkEngine,
        config: ClusterConfig,
        repairer: Repairer,
        stats: GCStats,
        ttl_s: Callable[[str], float | None],
    ) -> None:
        self.engine = engine
        self.config = config
        self.repairer = repairer
        self.stats = stats
        self.ttl_s = ttl_s  # the node's current TTL table (expired shards are not checked)

    def run(self, stopping: threading.Event) -> None:
        """Scrub for ever, a step at a time, at the pace that covers every shard once per ``scrub_period_s``
        (at most ``scrub_bytes_per_s``); a failing step is logged and retried after a pause."""
        position = self.engine.setting(POSITION) or None
        while True:
            gc, used = self.config.gc, self.engine.used_bytes
            rate = min(gc.scrub_bytes_per_s, max(1.0, used / gc.scrub_period_s))
            step = max(min(STEP_BYTES, used), 4096)
            if stopping.wait(step / rate):  # the time the step's bytes are due at this pace
                return
            try:
                position, _ = self._step(position, step)
                self.engine.set_setting(POSITION, position or b"")
            except NoSpace:  # (counted, and logged once, by the engine) where it got to is kept in memory
                pass
            except Exception:
                log.exception("scrub step failed")

    def scrub_now(self) -> dict[str, int]:
        """A whole pass now, at up to ``scrub_bytes_per_s``; returns what it checked, found and repaired."""
        before = self._counts()
        repaired_before = self.stats.scrub_repaired
        position: bytes | None = None
        started = time.monotonic()
        while True:
            position, _ = self._step(position, STEP_BYTES)
            lag = self.stats.scrub_bytes - before[1] - (time.monotonic() - started) * self.config.gc.scrub_bytes_per_s
            if lag > 0:
                time.sleep(lag / self.config.gc.scrub_bytes_per_s)
            if position is None:
                break
        shards, scanned, corrupt = (now - then for now, then in zip(self._counts(), before, strict=True))
        return {
            "shards_checked": shards,
            "bytes_checked": scanned,
            "corrupt": corrupt,
            "repaired": self.stats.scrub_repaired - repaired_before,
            "owed": self.engine.owed_summary()[0],
        }

    def _counts(self) -> tuple[int, int, int]:
        return self.stats.shards_scrubbed, self.stats.scrub_bytes, self.stats.scrub_corrupt

    def _step(self, position: bytes | None, max_bytes: int) -> tuple[bytes | None, int]:
        """Check about ``max_bytes`` from ``position`` on and repair what fails; returns where to go on from (None:
        the pass is complete) and the bytes checked."""
        step = self.engine.scrub(position, max_bytes, self.ttl_s)
        self.stats.shards_scrubbed += step.shards
        self.stats.scrub_bytes += step.bytes
        if step.corrupt:
            self.stats.scrub_corrupt += len(step.corrupt)
            log.warning("scrub: %d shards failed their crc32c; repairing them", len(step.corrupt))
            by_tenant: dict[str, list[tuple[bytes, int, float]]] = {}
            for tenant, key, index, created in step.corrupt:
                by_tenant.setdefault(tenant, []).append((key, index, created))
            for tenant, items in by_tenant.items():
                self.stats.scrub_repaired += self.repairer.repair_corrupt(tenant, items)
        if step.position is None:
            self.stats.scrub_passes += 1
        return step.position, step.bytes
