"""One dependency's availability as its client sees it: a line when it stops answering, a line when it answers
again, and counts of both.

A store, fetcher or directory that is down costs an engine its reuse; an engine must say so, once, not once per
request, and say so again when it is back. Each place that calls such a dependency reports every call's outcome
here (:meth:`Availability.failed`, :meth:`Availability.answered`); ``stats`` feeds the engine's metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class Availability:
    """Whether ``name`` answers, from the outcomes of the calls made to it. Thread-safe.

    ``effect`` says what its absence costs ("the engine recomputes"): it ends the line logged when it goes away.
    """

    def __init__(
        self, name: str, effect: str, log: logging.Logger, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name, self.effect, self.log, self.clock = name, effect, log, clock
        self.up = True
        self.outages = 0  # times it stopped answering
        self.recoveries = 0  # times it answered again
        self.failed_calls = 0  # calls that found it away, in all
        self._since = clock()
        self._failed_now = 0  # calls failed in the current outage
        self._lock = threading.Lock()

    def failed(self, error: object) -> None:
        """A call could not reach it (or it refused the call): the first of an outage logs one line."""
        with self._lock:
            self.failed_calls += 1
            self._failed_now += 1
            if not self.up:
                return
            self.up, self._since = False, self.clock()
            self.outages += 1
        self.log.warning("%s is not answering (%s): %s until it is back", self.name, error, self.effect)

    def answered(self) -> None:
        """A call got its answer: the first after an outage logs one line."""
        if self.up:  # (the usual case: no lock)
            return
        with self._lock:
            if self.up:
                return
            self.up = True
            self.recoveries += 1
            down_s, failed, self._failed_now = self.clock() - self._since, self._failed_now, 0
        self.log.warning("%s is answering again after %.1f s (%d calls went without it)", self.name, down_s, failed)

    def stats(self, prefix: str) -> dict[str, int]:
        """``{prefix}_up`` (1 or 0), ``_outages``, ``_recoveries`` and ``_failed_calls``."""
        return {
            f"{prefix}_up": int(self.up),
            f"{prefix}_outages": self.outages,
            f"{prefix}_recoveries": self.recoveries,
            f"{prefix}_failed_calls": self.failed_calls,
        }
