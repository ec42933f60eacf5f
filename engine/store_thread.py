"""The one thread an engine's store calls run on (lookups, fetches, puts), off the thread that steps its requests.

A store or fetcher that hangs (its nodes stopped, a link gone quiet) then costs the requests that need it, never
the others: their steps go on while the call waits out the client's own deadlines. The engine's store client is
not thread-safe, so every store call of an engine that uses this runs here, one after another, in the order given.

| state | meaning | ``submit`` |
|---|---|---|
| idle | no call running | queued |
| busy | a call running for at most ``stall_s`` | queued |
| stalled | a call running for longer than ``stall_s`` | refused (counted): a store this slow would queue them up |
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvtier.engine")

Job = Callable[[], None]


class StoreThread:
    """Runs ``submit``-ted jobs in order on a thread of its own; after each, hands its ``then`` to ``post`` (the
    worker loop's inbox, so that ``then`` runs on the stepping thread)."""

    def __init__(self, post: Callable[[Job], None], stall_s: float, name: str = "kvtier-store") -> None:
        self.post, self.stall_s = post, stall_s
        self.refused = 0  # jobs refused while stalled
        self._jobs: queue.SimpleQueue[tuple[Job, Job] | None] = queue.SimpleQueue()
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stalled(self) -> bool:
        """Whether the call running now has run for longer than ``stall_s``."""
        since = self._busy_since
        return since is not None and time.monotonic() - since > self.stall_s

    def submit(self, job: Job, then: Job) -> bool:
        """Queue ``job``; False (nothing queued, ``then`` never called) while stalled."""
        if self.stalled():
            self.refused += 1
            return False
        self._jobs.put((job, then))
        return True

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Run what is queued, then end; False if a call was still running after ``timeout_s`` (it is left to end
        by itself: the thread is a daemon)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, then = item
            self._busy_since = time.monotonic()
            try:
                job()
            except Exception:  # a bug: the store's own failures are misses, never exceptions
                log.exception("a store call failed")
            finally:
                self._busy_since = None
            self.post(then)
