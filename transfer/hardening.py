"""Keeping other processes of the same uid out of this one's memory.

A process that maps another tenant's blocks, or holds their tokens, is made non-dumpable (``PR_SET_DUMPABLE 0``):
another process of its uid can then neither ``ptrace`` it nor open its ``/proc/PID/mem``, ``/proc/PID/environ`` or
``/proc/PID/fd/*``, and it leaves no core dump. Root still can; tenants are not root. The fetcher does it at start;
an engine's :class:`~kvtier.transfer.fetch_client.FetchClient` when it first maps its tenant's segments.
"""

from __future__ import annotations

import ctypes

_PR_SET_DUMPABLE = 4


def not_dumpable() -> bool:
    """Make this process non-dumpable (see the module docstring); whether that worked (it does on Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
