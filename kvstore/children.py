"""Child processes that end with the process that started them.

``die_with_parent`` runs in the child between fork and exec (``subprocess.Popen(..., preexec_fn=die_with_parent)``):
the kernel sends it SIGTERM when its parent dies, however the parent dies (SIGKILL, or a signal handler that ends
the process without running ``finally`` blocks, as uvicorn's does when it re-raises SIGTERM). Linux only; elsewhere
it does nothing. The parent here is the *thread* that started the child: start such children from a thread that
lives as long as they should (the main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Have this (child) process receive SIGTERM when its parent dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
