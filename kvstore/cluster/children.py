"""Child processes: ones that end with the process that started them, and restarting ones that exit.

``die_with_parent`` runs in the child between fork and exec (``subprocess.Popen(..., preexec_fn=die_with_parent)``):
the kernel sends it SIGTERM when its parent dies, however the parent dies (SIGKILL, or a signal handler that ends
the process without running ``finally`` blocks, as uvicorn's does when it re-raises SIGTERM). Linux only; elsewhere
it does nothing. The parent here is the *thread* that started the child: start such children from a thread that
lives as long as they should (the main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
RESTART_BACKOFF_S = (1.0, 60.0)  # a child that exits is restarted after 1 s, doubling per quick exit up to 60 s
STABLE_S = 60.0  # a child up this long is healthy again: its next exit is restarted after the shortest wait


try:  # looked up here, not in the child: a dlopen between fork and exec could wait forever on a lock that another
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # thread of the parent held when it forked
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Have this (child) process receive SIGTERM when its parent dies."""
    if _prctl is not None:
        with contextlib.suppress(Exception):
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def ended_with(parent: int) -> bool:
    """For a child that cannot be given ``die_with_parent`` by its parent (one with gRPC threads: a ``preexec_fn``
    makes ``subprocess`` fork, and gRPC's fork handlers then broke the parent's poller, "epoll_wait error: Bad file
    descriptor"): call it first thing. The child then gets SIGTERM when ``parent`` dies; True when ``parent`` is
    already gone (the child should end now)."""
    die_with_parent()
    return os.getppid() != parent


def exit_reason(code: int) -> str:
    """How a child process ended, from its return code, in words: ``exited with code 2``, or for a signal its name
    and what it means (``killed by SIGBUS (Bus error)``)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    return f"killed by {name} ({signal.strsignal(-code)})"


class Backoff:
    """The wait before restarting one child that exited: ``RESTART_BACKOFF_S`` — the shortest first, doubling with
    each exit that follows a short run, up to the longest; a child that stayed up ``STABLE_S`` starts again from
    the shortest. Not thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.wait_s = RESTART_BACKOFF_S[0]

    def started_now(self) -> None:
        """The child was (re)started now."""
        self.started = self.clock()

    def exited(self) -> float:
        """The child exited now: how long to wait before starting it again."""
        short, longest = RESTART_BACKOFF_S
        if self.clock() - self.started >= STABLE_S:
            self.wait_s = short
        wait, self.wait_s = self.wait_s, min(longest, self.wait_s * 2)
        return wait
