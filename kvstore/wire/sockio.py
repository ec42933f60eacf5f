"""Socket I/O shared by the node (blocking sockets) and the client transport (non-blocking): gather/scatter
lists for ``sendmsg``/``recvmsg_into``, resuming partial sends, and receiving one frame on a blocking socket
through the sans-IO :class:`~kvtier.kvstore.wire.protocol.FrameReader`."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

from kvtier.kvstore.wire.protocol import Frame, FrameReader

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


def sendmsg_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send every byte of ``buffers`` on a blocking socket, resuming after partial ``sendmsg`` calls."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        consume(views, sock.sendmsg(views[:IOV_MAX]))


def recv_frame(
    sock: socket.socket, reader: FrameReader, before_recv: Callable[[FrameReader], None] | None = None
) -> Frame | None:
    """The next whole frame from a blocking socket, or None when the peer closed it between frames.

    ``before_recv(reader)`` runs before every receive: the node uses it to set timeouts and, once the frame's
    head is parsed, to receive the payload itself (then ``reader.payload_received()`` completes the frame).
    Raises ``ConnectionResetError`` when the peer closes mid-frame, and whatever the socket or the reader raise
    (timeouts, ``ProtocolError``).
    """
    while True:
        frame = reader.next_frame()
        if frame is not None:
            return frame
        if before_recv is not None:
            before_recv(reader)
            frame = reader.next_frame()  # the hook may have received the payload itself
            if frame is not None:
                return frame
        n = sock.recvmsg_into(reader.writable()[:IOV_MAX])[0]
        if n == 0:
            if reader.in_frame:
                raise ConnectionResetError("the peer closed the connection mid-frame")
            return None
        reader.advance(n)
