"""Gather/scatter lists for ``sendmsg``/``recvmsg_into``: the kernel's limit, and resuming partial sends."""

from __future__ import annotations

IOV_MAX = 1024  # buffers one sendmsg/recvmsg_into call may take (Linux UIO_MAXIOV)


def consume(views: list[memoryview], sent: int) -> None:
    """Drop the first ``sent`` bytes from ``views`` in place (after a partial ``sendmsg``)."""
    whole = 0
    while whole < len(views) and sent >= len(views[whole]):
        sent -= len(views[whole])
        whole += 1
    del views[:whole]
    if sent:
        views[0] = views[0][sent:]
