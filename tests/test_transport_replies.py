"""The client transport's receive of replies, against a scripted node on a real socket: a round of small requests is
sent and received in one compiled call (``Exchange._round_trip_heads``), and what that call cannot finish goes on in
the poll loop: a connection closed before the reply is resent once on a fresh one, a reply's payload is received
after its head, a node that does not answer costs one deadline. A request of any length goes with the round."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvtier.kvstore.wire.protocol import Frame, FrameReader, Limits, Op, encode_head
from kvtier.kvstore.wire.sockio import recv_frame
from kvtier.kvstore.wire.transport import ConnectionPool, Exchange

# per connection (numbered from 0) and request: the bytes to answer with, and whether to close the connection then
Script = Callable[[int, Frame], tuple[bytes, bool]]


@contextlib.contextmanager
def scripted_node(script: Script) -> Iterator[tuple[str, int]]:
    """A node that takes any HELLO, then answers each request as ``script`` says; yields its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    stopping = threading.Event()

    def serve(conn: socket.socket, number: int) -> None:
        with conn:
            reader = FrameReader()
            hello = recv_frame(conn, reader)
            assert hello is not None and hello.opcode == Op.HELLO
            conn.sendall(encode_head(Op.HELLO | Op.REPLY, hello.request_id, {"node_id": 0, "tenant": "default"}))
            while not stopping.is_set() and (frame := recv_frame(conn, reader)) is not None:
                answer, close = script(number, frame)
                conn.sendall(answer)
                if close:
                    return

    def accept() -> None:
        number = 0
        while not stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn, number), daemon=True).start()
            number += 1

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield listener.getsockname()
    finally:
        stopping.set()
        listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept: a close alone does not)
        listener.close()
        acceptor.join()


def live_reply(frame: Frame, payload: bytes = b"") -> bytes:
    return encode_head(Op.MATCH | Op.REPLY, frame.request_id, {"live": b"\x01"}, len(payload)) + payload


def match_once(address: tuple[str, int], timeout_s: float = 5.0) -> tuple[ConnectionPool, Frame | None, str | None]:
    pool = ConnectionPool({0: address}, "token", Limits())
    exchange = Exchange(pool)
    pending = exchange.request(0, Op.MATCH, {"keys": b"k" * 16, "klen": 16})
    exchange.run(timeout_s)
    return pool, pending.frame, pending.error


def test_a_connection_closed_after_the_request_went_out_is_resent_once_on_a_fresh_one() -> None:
    asked: list[int] = []

    def script(number: int, frame: Frame) -> tuple[bytes, bool]:
        asked.append(number)
        return (b"", True) if number == 0 else (live_reply(frame), False)

    with scripted_node(script) as address:
        pool, frame, error = match_once(address)
        assert error is None and frame is not None and frame.meta == {"live": b"\x01"}
        assert asked == [0, 1]
        pool.close()


def test_a_pooled_connection_the_node_closed_while_idle_is_replaced_for_the_next_round() -> None:
    asked: list[int] = []

    def script(number: int, frame: Frame) -> tuple[bytes, bool]:
        asked.append(number)
        return live_reply(frame), number == 0  # the first connection closes after its answer

    with scripted_node(script) as address:
        pool = ConnectionPool({0: address}, "token", Limits())
        for _ in range(2):
            exchange = Exchange(pool)
            pending = exchange.request(0, Op.MATCH, {"keys": b"k" * 16, "klen": 16})
            exchange.run(5.0)
            assert pending.error is None and pending.frame is not None
        assert asked == [0, 1]
        pool.close()


def test_a_request_longer_than_a_socket_takes_at_once_goes_out_whole_with_the_round() -> None:
    sizes: list[int] = []

    def script(_number: int, frame: Frame) -> tuple[bytes, bool]:
        sizes.append(len(frame.meta["keys"]))
        return live_reply(frame), False

    with scripted_node(script) as address:
        pool = ConnectionPool({0: address}, "token", Limits())
        exchange = Exchange(pool)
        pending = exchange.request(0, Op.MATCH, {"keys": b"k" * 16 * 4096, "klen": 16})  # 64 KiB of keys
        exchange.run(5.0)
        assert pending.error is None and pending.frame is not None and sizes == [16 * 4096]
        pool.close()


def test_a_reply_with_a_payload_is_received_whole_after_its_head() -> None:
    payload = bytes(range(256)) * 1000  # more than one receive's worth

    with scripted_node(lambda _number, frame: (live_reply(frame, payload), False)) as address:
        pool, frame, error = match_once(address)
        assert error is None and frame is not None and frame.payload is not None
        assert bytes(frame.payload) == payload
        pool.close()


def test_a_node_that_does_not_answer_costs_one_deadline_and_is_not_asked_again_at_once() -> None:
    def script(_number: int, _frame: Frame) -> tuple[bytes, bool]:
        time.sleep(2.0)
        return b"", True

    with scripted_node(script) as address:
        started = time.monotonic()
        pool, frame, error = match_once(address, timeout_s=0.3)
        assert frame is None and error == "timeout"
        assert 0.3 <= time.monotonic() - started < 1.5
        assert pool.get(0) is None  # backing off
        pool.close()


@pytest.mark.parametrize("cut", [10, 40], ids=["mid-header", "mid-metadata"])
def test_a_reply_cut_short_by_a_closed_connection_is_an_error_not_a_hang(cut: int) -> None:
    def script(_number: int, frame: Frame) -> tuple[bytes, bool]:
        return live_reply(frame)[:cut], True  # (resent once: cut short again)

    with scripted_node(script) as address:
        _, frame, error = match_once(address, timeout_s=2.0)
        assert frame is None and error is not None


def test_a_reply_whose_head_comes_after_the_rounds_quiet_time_is_received_on_the_same_connection() -> None:
    asked: list[int] = []
    payload = b"p" * 100_000

    def script(number: int, frame: Frame) -> tuple[bytes, bool]:
        asked.append(number)
        time.sleep(0.3)  # well past the round's wait for heads, well within the deadline
        return live_reply(frame, payload), False

    with scripted_node(script) as address:
        pool = ConnectionPool({0: address, 1: address}, "token", Limits())
        exchange = Exchange(pool)
        landed = [bytearray(len(payload)), bytearray(len(payload))]
        pendings = [
            exchange.request(node, Op.MATCH, {"keys": b"k" * 16, "klen": 16}, sink=lambda _head, b=buf: [memoryview(b)])
            for node, buf in enumerate(landed)
        ]
        exchange.run(5.0, until=lambda: False, heads_quiet_ms=1)  # as a read runs: late heads left to the loop
        assert all(p.error is None and p.frame is not None for p in pendings)
        assert landed == [payload, payload] and sorted(asked) == [0, 1]  # no connection replaced, nothing resent
        pool.close()
