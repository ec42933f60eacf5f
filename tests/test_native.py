"""The compiled data-path loops (csrc/native.c) against real sockets and files, and CRC-32C against the reference
``crc32c`` package."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
import threading
import time

import crc32c
import numpy as np
import pytest

from kvtier.kvstore import _native

# lengths around the 8-byte words, the 3-way interleaved blocks (3 × 256 and 3 × 8192 bytes), the folding steps
# (256 bytes at least, 128 bytes a step, then 32, 16 and the last bytes) and the hybrid's blocks (2048 + 3 × 896 bytes)
LENGTHS = [0, 1, 7, 8, 9, 255, 256, 257, 303, 767, 768, 769, 4735, 4736, 4737, 2 * 4736 + 9, 3 * 8192 - 1, 3 * 8192]
LENGTHS += [3 * 8192 + 9, 104_858, 1 << 20]


@pytest.mark.parametrize("impl", _native.CRC_IMPLS)
@pytest.mark.parametrize("length", LENGTHS)
def test_crc32c_matches_the_reference_at_any_length_and_alignment(length: int, impl: str) -> None:
    data = memoryview(os.urandom(length + 8))
    for start in (0, 3):
        view = data[start : start + length]
        assert _native.crc32c(view, 0, impl) == crc32c.crc32c(view)
        head = _native.crc32c(view[: length // 3], 0, impl)
        assert _native.crc32c(view[length // 3 :], head, impl) == crc32c.crc32c(view)


def test_crc32c_uses_the_fastest_implementation_and_refuses_an_unknown_one() -> None:
    data = os.urandom(4096)
    assert _native.CRC_IMPLS[0] == "table"
    assert _native.crc32c(data) == _native.crc32c(data, 0, _native.CRC_IMPLS[-1])
    with pytest.raises(ValueError, match="not available"):
        _native.crc32c(data, 0, "abacus")


def test_crc32c_many_checksums_each_buffer() -> None:
    buffers = [os.urandom(n) for n in (0, 5, 4096, 100_001)]
    assert _native.crc32c_many(buffers) == [crc32c.crc32c(b) for b in buffers]


def _plan(*rows: tuple[int, ...]) -> bytes:
    """(fd, offset, length[, stride]) rows; the stride defaults to the length."""
    return np.asarray([(*row, row[2]) if len(row) == 3 else row for row in rows], dtype=np.int64).tobytes()


def _crcs(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<u4").tolist()


def _send_later(
    sock: socket.socket, data: bytes, close: bool = False, chunk: int = 100_000, pause_s: float = 0.0
) -> threading.Thread:
    def send() -> None:
        for start in range(0, len(data), chunk):  # in pieces, so the receiver waits for some of them
            sock.sendall(data[start : start + chunk])
            time.sleep(pause_s)
        if close:
            sock.close()

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_recv_to_files_writes_each_shard_at_its_offset_and_drops_refused_ones(tmp_path) -> None:
    shards = [os.urandom(n) for n in (300_000, 7, 150_000, 64 << 10)]
    fd = os.open(tmp_path / "slab", os.O_RDWR | os.O_CREAT)
    a, b = socket.socketpair()
    with a, b:
        sender = _send_later(a, b"".join(shards))
        plan = _plan((fd, 0, len(shards[0])), (fd, 1 << 20, 7), (-1, 0, len(shards[2])), (fd, 2 << 20, 64 << 10))
        crcs = _native.recv_to_files(b.fileno(), 5000, plan, bytearray(16 << 10))
        sender.join()
    assert _crcs(crcs) == [crc32c.crc32c(s) for s in shards]
    for offset, shard in ((0, shards[0]), (1 << 20, shards[1]), (2 << 20, shards[3])):
        assert os.pread(fd, len(shard), offset) == shard
    assert os.pread(fd, 8, 1 << 20 | 7) == bytes(8)  # nothing of the dropped shard was written
    os.close(fd)


def test_recv_to_files_writes_adjacent_slots_whole_with_zero_tails(tmp_path) -> None:
    stride = 7168
    shards = [os.urandom(6554) for _ in range(40)]
    fd = os.open(tmp_path / "slab", os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, b"\xff" * (stride * 42), 0)  # old bytes: every slot's tail must come back as zeros
    a, b = socket.socketpair()
    with a, b:
        sender = _send_later(a, b"".join(shards))
        plan = _plan(*[(fd, (1 + i) * stride, 6554, stride) for i in range(40)])
        crcs = _native.recv_to_files(b.fileno(), 5000, plan, bytearray(16 << 10))  # pieces cut shards in two
        sender.join()
    assert _crcs(crcs) == [crc32c.crc32c(s) for s in shards]
    assert os.pread(fd, stride * 40, stride) == b"".join(s.ljust(stride, b"\0") for s in shards)
    assert os.pread(fd, stride, 0) == b"\xff" * stride and os.pread(fd, stride, 41 * stride) == b"\xff" * stride
    os.close(fd)


def test_recv_to_files_reports_a_peer_that_closes_mid_payload(tmp_path) -> None:
    a, b = socket.socketpair()
    with b:
        sender = _send_later(a, b"x" * 1000, close=True)
        with pytest.raises(ConnectionResetError):
            _native.recv_to_files(b.fileno(), 5000, _plan((-1, 0, 2000)), bytearray(8192))
        sender.join()


def test_recv_to_files_times_out_when_the_payload_stops_arriving() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x" * 100)
        with pytest.raises(TimeoutError):
            _native.recv_to_files(b.fileno(), 50, _plan((-1, 0, 200)), bytearray(8192))


def test_send_all_sends_every_buffer_through_partial_sends() -> None:
    buffers = [os.urandom(n) for n in (5, 3 << 20, 0, 70_000)] + [b"ab"] * 2000  # more buffers than one sendmsg
    a, b = socket.socketpair()
    assert _drained(a, b, lambda: _native.send_all(a.fileno(), 5000, buffers)) == b"".join(buffers)


def _drained(a: socket.socket, b: socket.socket, send: object) -> bytes:
    """What ``send()`` writes into ``a``, read from ``b`` by another thread."""
    received = bytearray()

    def drain() -> None:
        while chunk := b.recv(1 << 20):
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    with a:
        send()  # type: ignore[operator]
    reader.join()
    b.close()
    return bytes(received)


def test_send_all_sends_a_scatters_pieces_in_its_place() -> None:
    memory = bytearray(os.urandom(1 << 20))
    view = memoryview(memory)  # the Scatter keeps it exported: the memory cannot move while it lives
    base = int(np.frombuffer(_native.addresses([view]), dtype=np.int64)[0])
    pieces = [(700_000, 3000), (5, 0), (0, 10), (12, 600_000)] + [(9, 2)] * 2000  # more than one sendmsg takes
    scatter = _native.Scatter(np.asarray([(base + at, n) for at, n in pieces], dtype=np.int64), view)
    assert len(scatter) == sum(n for _, n in pieces)
    a, b = socket.socketpair()
    received = _drained(a, b, lambda: _native.send_all(a.fileno(), 5000, [b"head", scatter, b"tail"]))
    assert received == b"head" + b"".join(memory[at : at + n] for at, n in pieces) + b"tail"


def test_send_some_sends_from_an_offset_on_without_waiting_until_all_is_sent() -> None:
    memory = bytearray(os.urandom(1 << 20))
    view = memoryview(memory)
    base = int(np.frombuffer(_native.addresses([view]), dtype=np.int64)[0])
    pieces = [(500_000, 300_000), (7, 0), (0, 200_000)] + [(11, 3)] * 1500  # more than one sendmsg takes
    scatter = _native.Scatter(np.asarray([(base + at, n) for at, n in pieces], dtype=np.int64), view)
    items = [b"head", scatter, os.urandom(3 << 20)]
    wire = b"head" + b"".join(memory[at : at + n] for at, n in pieces) + items[2]
    a, b = socket.socketpair()
    a.setblocking(False)

    def send() -> None:
        sent = 2  # the first 2 bytes went out before: they are skipped
        while sent < len(wire):
            try:
                sent += _native.send_some(a.fileno(), items, sent)
            except BlockingIOError:  # the socket is full: wait for room, then resume
                select.select([], [a], [], 5)
        assert sent == len(wire)

    assert _drained(a, b, send) == wire[2:]


def test_send_some_raises_when_the_peer_is_gone() -> None:
    a, b = socket.socketpair()
    b.close()
    with a, pytest.raises(OSError):
        _native.send_some(a.fileno(), [b"x" * 100], 0)


def test_a_scatter_refuses_a_plan_that_is_not_address_length_pairs() -> None:
    with pytest.raises(ValueError):
        _native.Scatter(np.zeros(3, dtype=np.int64), None)
    with pytest.raises(ValueError):
        _native.Scatter(np.asarray([(0, -1)], dtype=np.int64), None)


def test_ec_encode_stripes_refuses_a_table_that_does_not_match_its_sizes() -> None:
    table, sizes = np.zeros((2, 12), dtype=np.int64), np.ones(2, dtype=np.int64)  # never called: checked first
    with pytest.raises(ValueError, match="pointer table"):
        _native.ec_encode_stripes(1, 1, 10, np.zeros((2, 10), dtype=np.int64), sizes)  # no output column
    with pytest.raises(ValueError, match="pointer table"):
        _native.ec_encode_stripes(1, 1, 10, table, np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError, match="sizes of 1"):
        _native.ec_encode_stripes(1, 1, 10, table, sizes * 0)


def test_crc32c_pieces_checksums_each_row_in_place() -> None:
    memory = bytearray(os.urandom(200_000))
    view = memoryview(memory)
    base = int(np.frombuffer(_native.addresses([view]), dtype=np.int64)[0])
    rows = [(0, 0), (3, 100_001), (150_000, 50_000)]
    plan = np.asarray([(base + at, n) for at, n in rows], dtype=np.int64)
    crcs = np.frombuffer(_native.crc32c_pieces(plan), dtype="<u4").tolist()
    assert crcs == [crc32c.crc32c(memory[at : at + n]) for at, n in rows]


def test_recv_scatter_checksums_each_shard_as_it_lands_across_partial_receives() -> None:
    shards = [os.urandom(n) for n in (300_000, 7, 6554)]
    memory = bytearray(sum(len(s) for s in shards) + 3)
    view = memoryview(memory)
    base = int(np.frombuffer(_native.addresses([view]), dtype=np.int64)[0])
    # shard 2 arrives as two pieces (its tail lands apart), and 3 unchecked bytes (shard -1) end the payload
    rows = [(0, 300_000, 0), (300_000, 7, 1), (300_007, 6000, 2), (306_010, 554, 2), (306_007, 3, -1)]
    plan = np.asarray([(base + at, n, shard) for at, n, shard in rows], dtype=np.int64)
    payload = b"".join(shards) + b"xyz"
    crcs = np.zeros(3, dtype=np.uint32)
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=lambda: [a.sendall(payload[i : i + 999]) for i in range(0, len(payload), 999)])
        sender.start()
        done = 0
        while done < len(payload):  # stops mid-piece, resumes where it stopped
            select.select([b], [], [], 5)
            with contextlib.suppress(BlockingIOError):
                done += _native.recv_scatter(b.fileno(), plan, done, crcs)
        sender.join()
    assert crcs.tolist() == [crc32c.crc32c(s) for s in shards]
    assert memory[:300_007] == payload[:300_007] and memory[306_007:306_010] == b"xyz"
    assert memory[300_007:306_007] + memory[306_010:] == shards[2]


def test_reply_plan_lands_data_shards_in_their_blocks_and_the_rest_in_scratch() -> None:
    blocks = [bytearray(25), bytearray(7)]  # shard length 3 for 25 bytes; 1 for 7
    base = np.frombuffer(_native.addresses(blocks), dtype=np.int64)
    rows = np.asarray([(0, 2, 3), (0, 8, 3), (1, 0, 1), (0, 10, 3), (1, 3, 2)], dtype=np.int64)  # block, index, len
    fits = np.asarray([True, True, True, True, False])  # the last one's length does not match its block
    pieces, scratch, parked = _native.reply_plan(
        rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy(), fits, base, np.asarray([25, 7], dtype=np.int64), 10
    )
    plan = np.frombuffer(pieces, dtype=np.int64).reshape(-1, 3)
    at = int(np.frombuffer(_native.addresses([scratch]), dtype=np.int64)[0])
    assert plan.tolist() == [
        [int(base[0]) + 6, 3, 0],  # data shard 2 of block 0 in place
        [int(base[0]) + 24, 1, 1],  # shard 8: one byte of the block, two bytes of zero padding into scratch
        [at, 2, 1],
        [int(base[1]), 1, 2],
        [at + 2, 3, 3],  # a parity shard into scratch, parked there for decoding
        [at + 5, 2, -1],  # a shard that does not fit: received into scratch, not checked
    ]
    assert len(scratch) == 7 and np.frombuffer(parked, dtype=np.int64).tolist() == [-1, -1, -1, 2, 5]


def test_bytearray_uninit_is_a_bytearray_of_that_size() -> None:
    buf = _native.bytearray_uninit(1 << 20)
    assert isinstance(buf, bytearray) and len(buf) == 1 << 20
    with pytest.raises(ValueError):
        _native.bytearray_uninit(-1)


def test_recv_scatter_lands_each_piece_at_its_address_and_resumes_where_it_stopped() -> None:
    first, second = bytearray(10), bytearray(6)
    views = [memoryview(first), memoryview(second)]  # exported while the plan points at them
    bases = np.frombuffer(_native.addresses(views), dtype=np.int64)
    plan = np.asarray([(bases[0] + 2, 5), (bases[1], 6)], dtype=np.int64)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"abc")
        assert _native.recv_scatter(b.fileno(), plan, 0) == 3
        with pytest.raises(BlockingIOError):  # nothing waiting
            _native.recv_scatter(b.fileno(), plan, 3)
        a.sendall(b"defghijk")
        assert _native.recv_scatter(b.fileno(), plan, 3) == 8
    assert first == b"\0\0abcde\0\0\0" and second == b"fghijk"


def test_addresses_refuses_a_read_only_buffer() -> None:
    with pytest.raises(BufferError):
        _native.addresses([b"read-only"])


def plan_of(buffer: bytearray) -> tuple[memoryview, np.ndarray]:
    """A one-piece (address, length) plan over ``buffer`` (the view keeps it exported while the plan is used)."""
    view = memoryview(buffer)
    return view, np.asarray([(int(np.frombuffer(_native.addresses([view]), dtype=np.int64)[0]), len(buffer))])


def test_recv_many_receives_on_every_socket_until_a_plan_is_full() -> None:
    big, small = bytearray(600_000), bytearray(5)
    (view_big, plan_big), (view_small, plan_small) = plan_of(big), plan_of(small)
    payload = os.urandom(len(big))
    (a1, b1), (a2, b2) = socket.socketpair(), socket.socketpair()
    with a1, b1, a2, b2, view_big, view_small:
        a2.sendall(b"ab")  # the small plan gets a part only: the call goes on until the big one is full
        sender = threading.Thread(target=a1.sendall, args=(payload,))
        sender.start()
        got, done = [0, 0], [0, 0]
        while done[0] < len(big):
            items = [(b1.fileno(), plan_big, done[0], None), (b2.fileno(), plan_small, done[1], None)]
            results = _native.recv_many(items, 5000)
            assert all(err == 0 for _, err in results)
            for i, (n, _) in enumerate(results):
                got[i] += 1 if n else 0
                done[i] += n
        sender.join()
    assert big == payload and small[:2] == b"ab" and done == [len(big), 2]
    assert got[0] <= 3  # a few returns for 600 KB, not one per socket buffer's worth


def test_recv_many_returns_when_a_watched_socket_is_readable_and_says_which_peer_closed() -> None:
    buffer = bytearray(10)
    view, plan = plan_of(buffer)
    (a1, b1), (a2, b2) = socket.socketpair(), socket.socketpair()
    with a1, b1, a2, b2, view:
        a2.sendall(b"header")  # a watched socket (no payload under way) with bytes: Python reads them
        items = [(b1.fileno(), plan, 0, None), (b2.fileno(), None, 0, None)]
        assert _native.recv_many(items, 5000) == [(0, 0), (0, 0)]
        a1.sendall(b"xyz")
        a1.close()
        assert _native.recv_many(items[:1], 5000) == [(3, -1)]  # 3 bytes, then the peer closed
    assert buffer[:3] == b"xyz"


def test_recv_many_publishes_each_plans_progress_while_it_is_still_receiving() -> None:
    buffer = bytearray(1000)
    view, plan = plan_of(buffer)
    progress = np.zeros(1, dtype=np.int64)
    a, b = socket.socketpair()
    with a, b, view:
        returned: list[list[tuple[int, int]]] = []
        receiver = threading.Thread(
            target=lambda: returned.append(_native.recv_many([(b.fileno(), plan, 100, None, progress)], 5000))
        )
        receiver.start()
        a.sendall(b"x" * 300)  # the plan (900 bytes left after the 100 done) is not full: the call goes on
        deadline = time.monotonic() + 5
        while progress[0] != 400 and time.monotonic() < deadline:
            time.sleep(0.001)
        seen = int(progress[0])  # the bytes before it, done and received, while the call has not returned
        assert not returned
        a.sendall(b"y" * 600)
        receiver.join()
    assert seen == 400 and returned == [[(900, 0)]] and int(progress[0]) == 1000


def test_recv_scatter_publishes_its_progress() -> None:
    buffer = bytearray(10)
    view, plan = plan_of(buffer)
    progress = np.zeros(1, dtype=np.int64)
    a, b = socket.socketpair()
    with a, b, view:
        b.setblocking(False)
        a.sendall(b"abcd")
        assert _native.recv_scatter(b.fileno(), plan, 3, None, progress) == 4
    assert int(progress[0]) == 7 and buffer[3:7] == b"abcd"


def test_a_progress_cell_that_cannot_hold_an_int64_is_refused() -> None:
    buffer = bytearray(10)
    view, plan = plan_of(buffer)
    a, b = socket.socketpair()
    with a, b, view, pytest.raises(ValueError, match="int64 cell"):
        _native.recv_many([(b.fileno(), plan, 0, None, np.zeros(1, dtype=np.int32))], 50)


def test_recv_many_gives_up_after_its_timeout() -> None:
    buffer = bytearray(10)
    view, plan = plan_of(buffer)
    a, b = socket.socketpair()
    with a, b, view:
        started = time.monotonic()
        assert _native.recv_many([(b.fileno(), plan, 0, None)], 50) == [(0, 0)]
        assert time.monotonic() - started >= 0.04


def _frame_head(length: int, fill: bytes = b"m") -> bytes:
    """A 32-byte head whose uint32 at byte 16 announces ``length`` more bytes, and those bytes."""
    return b"h" * 16 + length.to_bytes(4, "little") + b"h" * 12 + fill * length


def test_recv_heads_takes_from_each_socket_its_head_and_the_bytes_it_announces_as_they_arrive() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    heads = [_frame_head(n, bytes([65 + i])) for i, n in enumerate((0, 100, 5000))]
    for _, b in pairs:
        b.setblocking(False)
    senders = [
        _send_later(a, head + b"next", chunk=700, pause_s=0.002) for (a, _), head in zip(pairs, heads, strict=True)
    ]
    got = _native.recv_heads([b.fileno() for _, b in pairs], 5000, 32, 16, 1 << 20)
    for sender in senders:
        sender.join()
    assert got == heads  # and nothing of what follows
    assert [b.recv(100) for _, b in pairs] == [b"next"] * 3
    for a, b in pairs:
        a.close()
        b.close()


def test_recv_heads_reports_per_socket_a_closed_peer_a_timeout_and_a_head_too_long_to_take() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    for _, b in pairs:
        b.setblocking(False)
    pairs[0][0].sendall(b"h" * 10)
    pairs[0][0].close()  # closed mid-head
    pairs[1][0].sendall(_frame_head(50)[:40])  # the rest never comes
    pairs[2][0].sendall(_frame_head(1 << 16))  # more than the 4 KiB allowed: the head alone
    got = _native.recv_heads([b.fileno() for _, b in pairs], 100, 32, 16, 4 << 10)
    assert got == [-1, errno.ETIMEDOUT, _frame_head(1 << 16)[:32]]
    for a, b in pairs:
        a.close()
        b.close()


def test_recv_heads_leaves_a_socket_that_got_nothing_by_the_timeout_in_step_for_a_later_call() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        assert _native.recv_heads([b.fileno()], 30, 32, 16, 4 << 10) == [None]
        a.sendall(_frame_head(5))
        assert _native.recv_heads([b.fileno()], 5000, 32, 16, 4 << 10) == [_frame_head(5)]


def _heads_with_a_silent_socket(now: bytes, later: bytes) -> tuple[list[bytes | int | None], float]:
    """recv_heads (quiet time 30 ms) over two sockets: the first gets ``now`` at once and ``later`` 0.2 s on, the
    second nothing. Returns what it got and the seconds it took."""
    (a1, b1), (a2, b2) = socket.socketpair(), socket.socketpair()
    with a1, b1, a2, b2:
        b1.setblocking(False)
        b2.setblocking(False)
        a1.sendall(now)
        timer = threading.Timer(0.2, a1.sendall, args=(later,))
        timer.start()
        started = time.monotonic()
        got = _native.recv_heads([b1.fileno(), b2.fileno()], 5000, 32, 16, 4 << 10, None, 30)
        timer.join()
    return got, time.monotonic() - started


def test_recv_heads_leaves_a_silent_socket_after_the_quiet_time_but_waits_for_a_head_begun() -> None:
    head = _frame_head(20)
    got, took = _heads_with_a_silent_socket(head[:10], head[10:])  # begun: the rest well before the timeout
    assert got == [head, None] and took < 2


def test_recv_heads_counts_the_quiet_time_from_the_first_whole_head() -> None:
    head = _frame_head(20)
    got, took = _heads_with_a_silent_socket(b"", head)  # the first head whole long after the quiet time
    assert got == [head, None] and 0.2 <= took < 2  # the silent one: left 30 ms after it


def test_recv_heads_sends_each_request_whole_before_taking_the_replies() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    requests = [bytes([97 + i]) * (10 + 1000 * i) for i in range(3)]
    heads = [_frame_head(n, bytes([65 + i])) for i, n in enumerate((0, 10, 300))]

    def answer(sock: socket.socket, request: bytes, head: bytes) -> None:
        got = b""
        while len(got) < len(request):
            got += sock.recv(len(request) - len(got))
        assert got == request
        sock.sendall(head)

    for _, b in pairs:
        b.setblocking(False)
    nodes = [
        threading.Thread(target=answer, args=(a, request, head))
        for (a, _), request, head in zip(pairs, requests, heads, strict=True)
    ]
    for node in nodes:
        node.start()
    got = _native.recv_heads([b.fileno() for _, b in pairs], 5000, 32, 16, 1 << 20, requests)
    for node in nodes:
        node.join()
    assert got == heads
    for a, b in pairs:
        a.close()
        b.close()


def test_recv_heads_reports_a_send_that_fails_or_does_not_go_out_in_time_and_receives_nothing_on_that_socket() -> None:
    closed, full, quiet = (socket.socketpair() for _ in range(3))
    for _, b in (closed, full, quiet):
        b.setblocking(False)
    closed[0].close()
    with contextlib.suppress(BlockingIOError):
        while True:  # the socket cannot take the request, and nobody reads
            full[1].send(b"x" * 65536)
    full[0].sendall(_frame_head(0))  # (a reply that is waiting is not taken either)
    sends = [b"request", b"request", None]
    got = _native.recv_heads([closed[1].fileno(), full[1].fileno(), quiet[1].fileno()], 50, 32, 16, 4096, sends)
    assert got == [errno.EPIPE, errno.ETIMEDOUT, None]  # the quiet one: nothing came before the timeout
    assert full[1].recv(100) == _frame_head(0)
    for sock in (*closed[1:], *full, *quiet):
        sock.close()


def test_recv_heads_sends_a_request_larger_than_the_socket_takes_at_once_whole_as_the_peer_reads_it() -> None:
    a, b = socket.socketpair()
    request = os.urandom(4 << 20)
    head = _frame_head(7)

    def node() -> None:
        got = bytearray()
        while len(got) < len(request):
            got += a.recv(1 << 20)
        a.sendall(head if got == request else b"")

    with a, b:
        b.setblocking(False)
        peer = threading.Thread(target=node)
        peer.start()
        got = _native.recv_heads([b.fileno()], 5000, 32, 16, 4096, [request])
        peer.join()
    assert got == [head]


def test_recv_heads_refuses_a_length_field_outside_the_head() -> None:
    with pytest.raises(ValueError, match="within the head"):
        _native.recv_heads([], 100, 32, 30, 1 << 20)


def test_recv_head_takes_a_head_and_its_metadata_whole_and_nothing_after() -> None:
    a, b = socket.socketpair()
    with a, b:
        sender = _send_later(a, _frame_head(3000) + b"payload", chunk=500, pause_s=0.002)
        assert _native.recv_head(b.fileno(), 32, 16, 4096) == (_frame_head(3000), 1)
        sender.join()
        assert b.recv(100) == b"payload"


def test_recv_head_says_what_stopped_it_short_with_what_arrived() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    (a0, b0), (a1, b1), (a2, b2) = pairs
    a0.sendall(_frame_head(8192))  # metadata over the 4 KiB taken: the head alone
    assert _native.recv_head(b0.fileno(), 32, 16, 4096) == (_frame_head(8192)[:32], 2)
    a1.sendall(b"h" * 20)
    b1.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))  # 50 ms
    assert _native.recv_head(b1.fileno(), 32, 16, 4096) == (b"h" * 20, 0)
    a2.sendall(b"h" * 20)
    a2.close()
    assert _native.recv_head(b2.fileno(), 32, 16, 4096) == (b"h" * 20, -1)
    assert _native.recv_head(b2.fileno(), 32, 16, 4096) == (b"", -1)
    for a, b in pairs:
        a.close()
        b.close()


def _jump_reference(key: int, buckets: int) -> int:
    """Lamping and Veach's loop, in Python integers and floats."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) % (1 << 64)
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return max(b, 0)


@pytest.mark.parametrize("buckets", [1, 2, 3, 12, 1000])
def test_jump_hash_is_lamping_and_veachs_loop(buckets: int) -> None:
    keys = np.frombuffer(np.random.default_rng(buckets).bytes(8 * 500), dtype=np.uint64)
    out = np.empty(len(keys), dtype=np.int64)
    _native.jump_hash(keys, buckets, out)
    assert out.tolist() == [_jump_reference(int(k), buckets) for k in keys]


def test_primary_runs_sorts_keys_by_their_primary_stably_with_each_primarys_run() -> None:
    groups = np.array([list(range(12)), [3, *range(20, 31)], list(range(40, 52))], dtype=np.int64)
    keys = np.frombuffer(np.random.default_rng(7).bytes(16 * 2000), dtype=np.uint8).reshape(2000, 16)
    h = keys[:, :8].copy().view("<u8").ravel()
    primary = np.array([groups[_jump_reference(int(k), 3), int(k) % 12] for k in h])
    order, runs, rows = _native.primary_runs(keys.tobytes(), 16, groups, 12)
    expected = np.argsort(primary, kind="stable")
    assert np.frombuffer(order, dtype=np.int64).tolist() == expected.tolist()
    assert rows == keys[expected].tobytes()
    nodes, starts, counts = np.unique(primary[expected], return_index=True, return_counts=True)
    assert runs == [(int(n), int(lo), int(lo + c)) for n, lo, c in zip(nodes, starts, counts, strict=True)]


@pytest.mark.parametrize(
    ("klen", "groups", "message"),
    [(16, [[-1] * 12], "node id -1 is out of range"), (16, [[65536] * 12], "out of range"), (4, [[0] * 12], "8 bytes")],
)
def test_primary_runs_refuses_short_keys_and_node_ids_out_of_range(klen: int, groups: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _native.primary_runs(b"k" * 32, klen, np.array(groups, dtype=np.int64), 12)
