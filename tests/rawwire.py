"""Speaking kvtier's frames by hand over real sockets, for tests that send what a well-behaved client never would:
bare headers, frames cut short, connections from chosen loopback addresses; and reading a process's memory."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest

from kvtier.kvstore.wire.protocol import HEADER, MAGIC, PROTOCOL_VERSION, Frame, FrameReader, Op, encode_head

SOCKET_TIMEOUT_S = 5.0


def connect_from(
    addr: tuple[str, int], source_ip: str = "127.0.0.1", timeout_s: float = SOCKET_TIMEOUT_S
) -> socket.socket:
    """A TCP connection to ``addr`` from ``source_ip`` (any of 127.0.0.0/8 is this machine: a peer of its own)."""
    sock = socket.create_connection(addr, timeout=timeout_s, source_address=(source_ip, 0))
    sock.settimeout(timeout_s)
    return sock


def raw_header(
    opcode: int,
    rid: int = 1,
    meta_len: int = 0,
    payload_len: int = 0,
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    crc: int | None = None,
) -> bytes:
    """A bare 32-byte header (crc correct unless given); the server reads exactly these bytes before refusing."""
    head = HEADER.pack(magic, version, opcode, 0, rid, meta_len, payload_len, 0)[:28]
    return head + struct.pack("<I", crc32c.crc32c(head) if crc is None else crc)


def send_frame(sock: socket.socket, opcode: int, meta: dict[str, Any], payload: bytes = b"", rid: int = 1) -> None:
    sock.sendall(encode_head(opcode, rid, meta, len(payload)) + payload)


def recv_frame(sock: socket.socket) -> Frame | None:
    """The next frame from the server, or None if it closed the connection first."""
    reader = FrameReader()
    while True:
        frame = reader.next_frame()
        if frame is not None:
            return frame
        n = sock.recv_into(reader.writable()[0])
        if n == 0:
            return None
        reader.advance(n)


def assert_closed(sock: socket.socket) -> list[Frame]:
    """The server closes the connection (after at most some ERROR frames, which are returned).

    A reset counts as a close: a server that gives up on a frame before reading all of it closes a socket
    with unread bytes, which the kernel turns into RST.
    """
    frames = []
    while True:
        try:
            frame = recv_frame(sock)
        except ConnectionResetError:
            return frames
        if frame is None:
            return frames
        assert frame.opcode == Op.ERROR, f"a reply instead of an error: {frame}"
        frames.append(frame)


def try_hello(sock: socket.socket, token: str) -> Frame | None:
    """HELLO's answer (a reply or an ERROR), or None if the server closed the connection instead."""
    try:
        send_frame(sock, Op.HELLO, {"token": token})
        return recv_frame(sock)
    except OSError:
        return None


@contextlib.contextmanager
def hold_connections(
    connect: Callable[[], socket.socket], token: str, attempts: int
) -> Iterator[tuple[list[socket.socket], int]]:
    """Connect ``attempts`` times and HELLO on each: yields (the connections the server authenticated, how many
    it turned away instead); every connection is closed after."""
    held: list[socket.socket] = []
    turned_away = 0
    try:
        for _ in range(attempts):
            sock = connect()
            reply = try_hello(sock, token)
            if reply is not None and reply.opcode == Op.HELLO | Op.REPLY:
                held.append(sock)
            else:
                turned_away += 1
                sock.close()
        yield held, turned_away
    finally:
        for sock in held:
            sock.close()


def error_code(sock: socket.socket) -> int | None:
    """The code of the ERROR the server answers with before closing (None: closed without one)."""
    frames = assert_closed(sock)
    return frames[0].meta.get("code") if frames else None


def trickle_until_cut(
    conns: list[socket.socket], message: bytes, meanwhile: Callable[[], None] = lambda: None, interval_s: float = 0.25
) -> float:
    """Send ``message`` a byte every ``interval_s`` on every connection (never its last byte) until the server has
    closed them all, calling ``meanwhile()`` each round; returns how long that took, or fails the test if the
    message ran out first."""
    opened = time.monotonic()
    open_ = list(conns)
    for i in range(len(message) - 1):
        for sock in open_:
            with contextlib.suppress(OSError):
                sock.send(message[i : i + 1])
        for sock in select.select(open_, [], [], interval_s)[0]:
            open_.remove(sock)
        if not open_:
            return time.monotonic() - opened
        meanwhile()
    pytest.fail(f"{len(open_)} of {len(conns)} connections still open after {time.monotonic() - opened:.1f} s")


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (``VmRSS``) or its peak (``VmHWM``), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} missing from /proc/{pid}/status")


def raw_map(socket_path: Path, token: str, segments: list[int]) -> tuple[dict[str, Any], list[int]]:
    """MAP ``segments`` on a raw connection to the fetcher at ``socket_path``: (the reply's metadata, the descriptors
    that came with it)."""
    from kvtier.transfer import fetch_protocol as fp

    with socket.socket(socket.AF_UNIX) as raw:
        raw.settimeout(SOCKET_TIMEOUT_S)
        raw.connect(str(socket_path))
        raw.sendall(encode_head(Op.HELLO, 0, {"token": token}))
        reader = FrameReader()
        while not reader.feed(raw.recv(4096)):
            pass
        raw.sendall(encode_head(fp.FetchOp.MAP, 1, fp.map_meta(segments)))
        frames: list[Frame | None] = []
        fds: list[int] = []
        while not frames:
            data, got, _, _ = socket.recv_fds(raw, 1 << 16, 16)
            fds += got
            frames = list(reader.feed(data)) if data else [None]
        return (frames[0].meta if frames[0] is not None else {}), fds
