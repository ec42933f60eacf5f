"""Node security over real sockets: authentication, malformed input, memory limits and tenant isolation.

One 12-node cluster (real node processes started by :class:`LocalCluster`) serves the whole module. Raw
sockets speak the wire protocol by hand to node 0 so each bad input is exactly what the test says; the
real :class:`Client` then checks that the node keeps serving well-behaved peers.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.kvstore.client import Client, connect
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.wire.protocol import PROTOCOL_VERSION, ErrorCode, Frame, FrameReader, Op, encode_head
from kvtier.kvstore.wire.transport import AuthError

from .conftest import wait_for
from .rawwire import SOCKET_TIMEOUT_S, assert_closed, raw_header, recv_frame, rss_kib, send_frame

TEAMB_TOKEN = secrets.token_hex(16)
TARGET = 0  # the node every raw-socket test talks to
BLOCK = 16 << 10

# -- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    path = cluster_mod.write_default(tmp_path_factory.mktemp("security"), capacity_bytes=256 << 20)
    # every bad connection here comes from 127.0.0.1, as do the good ones: no allowance for failed HELLOs runs out
    limits = "[limits]\nmax_auth_failures_per_peer = 100000\n"
    path.write_text(path.read_text() + f'\n[tenants.teamb]\ntoken = "{TEAMB_TOKEN}"\n\n{limits}')
    with LocalCluster(path) as lc:
        with Client(lc.config) as client:
            wait_for(lambda: every_node_rebuilt(client), 120, "the new nodes' rebuilds to end", poll_s=0.5)
        yield lc


def every_node_rebuilt(client: Client) -> bool:
    """A new node is rebuilding (MATCH answers 2, unknown, for a key it has no record of) until its peers said what
    it should hold: the raw MATCHes here expect 0."""
    return not any(info.get("rebuilding", True) for info in client.node_info().values())


@pytest.fixture(scope="module")
def path(local: LocalCluster) -> Path:
    return local.config_path


@pytest.fixture(scope="module")
def admin_token(local: LocalCluster) -> str:
    return local.config.token


# -- raw protocol helpers --------------------------------------------------------------------------------


def open_raw(local: LocalCluster, node_id: int = TARGET) -> socket.socket:
    node = local.config.nodes[node_id]
    sock = socket.create_connection((node.host, node.port), timeout=SOCKET_TIMEOUT_S)
    sock.settimeout(SOCKET_TIMEOUT_S)
    return sock


def hello(sock: socket.socket, token: str) -> Frame:
    send_frame(sock, Op.HELLO, {"token": token, "client": "test"}, rid=1)
    reply = recv_frame(sock)
    assert reply is not None and reply.opcode == Op.HELLO | Op.REPLY, reply
    return reply


def assert_error_then_closed(sock: socket.socket, code: ErrorCode, request_id: int | None = None) -> None:
    try:
        frame = recv_frame(sock)
    except ConnectionResetError:
        raise AssertionError("the node reset the connection (it closed with unread bytes): no ERROR frame") from None
    assert frame is not None, "the node closed the connection without an ERROR frame"
    assert frame.opcode == Op.ERROR, frame
    assert frame.meta.get("code") == code, frame.meta
    assert isinstance(frame.meta.get("message"), str)
    if request_id is not None:
        assert frame.request_id == request_id
    try:
        rest = sock.recv(1)
    except ConnectionResetError:
        rest = b""  # reset after the ERROR frame: closed all the same
    assert rest == b"", "the connection stayed open after the ERROR frame"


def keys_meta(keys: list[bytes]) -> dict[str, Any]:
    return {"keys": b"".join(keys), "klen": 16}


def random_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def random_blocks(n: int, size: int = BLOCK) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def node_rss_kib(local: LocalCluster, node_id: int, field: str = "VmRSS") -> int:
    return rss_kib(local.procs[node_id].pid, field)


def assert_node_serves(local: LocalCluster, node_id: int = TARGET) -> None:
    """The node process is alive, answers a fresh raw connection, and a client put/get round-trips."""
    assert local.procs[node_id].poll() is None, "the node process died"
    with open_raw(local, node_id) as sock:
        assert hello(sock, local.config.token).meta["node_id"] == node_id
        send_frame(sock, Op.MATCH, keys_meta(random_keys(3)), rid=2)
        reply = recv_frame(sock)
        assert reply is not None and reply.opcode == Op.MATCH | Op.REPLY and reply.request_id == 2
        assert reply.meta["live"] == b"\x00\x00\x00"
    with Client(local.config) as client:
        assert_round_trip(client)


def assert_round_trip(client: Client) -> None:
    keys, blocks = random_keys(3), random_blocks(3)
    assert client.put(keys, blocks) == [True] * 3
    assert client.get(keys) == blocks
    out = [bytearray(BLOCK) for _ in keys]
    assert client.get_into(keys, out) == [True] * 3
    assert out == blocks
    assert client.match(keys) == 3


# -- the bad connections ---------------------------------------------------------------------------------
# Each sends exactly what the node reads before it gives up (no unread bytes), authenticating first where
# the case needs it, and returns (expected error code, request id the error should echo or None).


def _not_hello(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    send_frame(sock, Op.MATCH, keys_meta(random_keys(1)), rid=5)
    return ErrorCode.AUTH_REQUIRED, 5


def _wrong_token(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    send_frame(sock, Op.HELLO, {"token": "wrong" * 4}, rid=6)
    return ErrorCode.AUTH_FAILED, 6


def _bad_magic(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: kvtier\r\n\r\n"[:32].ljust(32, b"\n"))
    return ErrorCode.BAD_FRAME, None


def _bad_crc(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    sock.sendall(raw_header(Op.HELLO, crc=0xDEADBEEF))
    return ErrorCode.BAD_FRAME, None


def _wrong_version(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    sock.sendall(raw_header(Op.HELLO, version=PROTOCOL_VERSION + 1))
    return ErrorCode.BAD_FRAME, None


def _pre_auth_payload(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    sock.sendall(raw_header(Op.HELLO, payload_len=1 << 20))  # no payload is allowed before HELLO
    return ErrorCode.TOO_LARGE, None


def _pre_auth_huge_meta(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    sock.sendall(raw_header(Op.HELLO, meta_len=1 << 30))
    return ErrorCode.TOO_LARGE, None


def _authed_huge_payload(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    sock.sendall(raw_header(Op.PUT_SHARDS, rid=2, payload_len=2**40))
    return ErrorCode.TOO_LARGE, None


def _authed_huge_meta(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    sock.sendall(raw_header(Op.MATCH, rid=2, meta_len=2**32 - 1))
    return ErrorCode.TOO_LARGE, None


def _put_lens_do_not_add_up(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    meta = {
        **keys_meta(random_keys(2)),
        "idx": bytes([0, 1]),
        "lens": np.array([4096, 4096], dtype="<u4").tobytes(),  # 8 KiB announced …
        "blen": np.array([40960, 40960], dtype="<u8").tobytes(),
        "cls": "chatbot",
        "put": b"put-9",
    }
    send_frame(sock, Op.PUT_SHARDS, meta, b"s" * 4096, rid=9)  # … 4 KiB sent
    return ErrorCode.BAD_REQUEST, 9


def _keys_blob_wrong_length(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    send_frame(sock, Op.MATCH, {"keys": b"k" * 17, "klen": 16}, rid=10)
    return ErrorCode.BAD_REQUEST, 10


def _bad_key_length(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    send_frame(sock, Op.DELETE, {"keys": b"k" * 64, "klen": 8}, rid=11)
    return ErrorCode.BAD_REQUEST, 11


def _idx_length_mismatch(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    send_frame(sock, Op.GET_SHARDS, {**keys_meta(random_keys(3)), "idx": bytes([0, 1])}, rid=12)
    return ErrorCode.BAD_REQUEST, 12


def _shard_index_out_of_range(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    send_frame(sock, Op.GET_SHARDS, {**keys_meta(random_keys(1)), "idx": bytes([12])}, rid=13)
    return ErrorCode.BAD_REQUEST, 13


def _unknown_opcode(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    send_frame(sock, 0x42, {}, rid=14)
    return ErrorCode.BAD_REQUEST, 14


def _second_hello(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    send_frame(sock, Op.HELLO, {"token": TEAMB_TOKEN}, rid=15)  # no re-authenticating as someone else
    return ErrorCode.BAD_REQUEST, 15


def _metadata_not_a_map(sock: socket.socket, token: str) -> tuple[ErrorCode, int | None]:
    hello(sock, token)
    body = b"\x93\x01\x02\x03"  # msgpack [1, 2, 3]
    sock.sendall(raw_header(Op.MATCH, rid=16, meta_len=len(body)) + body)
    return ErrorCode.BAD_FRAME, None


BadConnection = Callable[[socket.socket, str], tuple[ErrorCode, int | None]]

PRE_AUTH_CASES: dict[str, BadConnection] = {
    "not-hello": _not_hello,
    "wrong-token": _wrong_token,
    "bad-magic": _bad_magic,
    "bad-crc": _bad_crc,
    "wrong-version": _wrong_version,
    "pre-auth-payload": _pre_auth_payload,
    "pre-auth-huge-meta": _pre_auth_huge_meta,
}
AUTHED_CASES: dict[str, BadConnection] = {
    "huge-payload": _authed_huge_payload,
    "huge-meta": _authed_huge_meta,
    "put-lens-do-not-add-up": _put_lens_do_not_add_up,
    "keys-blob-wrong-length": _keys_blob_wrong_length,
    "bad-key-length": _bad_key_length,
    "idx-length-mismatch": _idx_length_mismatch,
    "shard-index-out-of-range": _shard_index_out_of_range,
    "unknown-opcode": _unknown_opcode,
    "second-hello": _second_hello,
    "metadata-not-a-map": _metadata_not_a_map,
}
ALL_CASES = {**PRE_AUTH_CASES, **AUTHED_CASES}


def run_bad(local: LocalCluster, case: BadConnection, token: str) -> tuple[list[Frame], ErrorCode]:
    with open_raw(local) as sock:
        code, _ = case(sock, token)
        return assert_closed(sock), code


# -- authentication --------------------------------------------------------------------------------------


def test_hello_with_cluster_token_authenticates_tenant_default_as_admin(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        reply = hello(sock, admin_token)
    assert reply.meta == {"node_id": TARGET, "tenant": "default", "admin": True}
    assert reply.request_id == 1


def test_hello_with_tenant_token_authenticates_that_tenant_without_admin(local: LocalCluster):
    with open_raw(local) as sock:
        reply = hello(sock, TEAMB_TOKEN)
    assert reply.meta == {"node_id": TARGET, "tenant": "teamb", "admin": False}


def test_first_frame_not_hello_gets_auth_required_and_close(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        code, rid = _not_hello(sock, admin_token)
        assert code == ErrorCode.AUTH_REQUIRED
        assert_error_then_closed(sock, ErrorCode.AUTH_REQUIRED, rid)


@pytest.mark.parametrize(
    "frame",
    [
        raw_header(42, rid=9),  # an opcode nobody knows
        encode_head(Op.MATCH, 9, {"keys": b"k" * 16, "klen": 16, "bogus": 1}),  # a field MATCH does not have
        encode_head(Op.GET_SHARDS, 9, {"keys": [1, 2, 3]}),  # a field of the wrong type
        raw_header(Op.PUT_SHARDS, rid=9, meta_len=0, payload_len=1 << 20),  # a payload, before HELLO
        raw_header(Op.STAT, rid=9, meta_len=64 << 10),  # more metadata than a HELLO may have
    ],
    ids=["unknown-opcode", "unknown-field", "wrong-type", "payload", "large-metadata"],
)
def test_any_frame_other_than_hello_first_gets_auth_required_whatever_it_holds(local: LocalCluster, frame: bytes):
    with open_raw(local) as sock:
        sock.sendall(frame)  # the node answers at the header: nothing after it is read
        assert_error_then_closed(sock, ErrorCode.AUTH_REQUIRED, 9)


def test_hello_with_wrong_token_gets_auth_failed_and_close(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        code, rid = _wrong_token(sock, admin_token)
        assert_error_then_closed(sock, code, rid)


@pytest.mark.parametrize(
    "meta",
    [{"token": "wrong" * 4}, {"token": ""}, {"token": 12345}, {"token": b"x" * 32}, {}, {"token": None}],
    ids=["wrong", "empty", "int", "bytes", "missing", "nil"],
)
def test_hello_with_bad_token_gets_auth_failed_and_is_closed(local: LocalCluster, meta: dict[str, Any]):
    with open_raw(local) as sock:
        send_frame(sock, Op.HELLO, meta)
        frames = assert_closed(sock)
    assert [f.meta.get("code") for f in frames] == [ErrorCode.AUTH_FAILED]


def test_hello_with_a_prefix_of_the_real_token_is_refused(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        send_frame(sock, Op.HELLO, {"token": admin_token[:-1]})
        assert_closed(sock)


@pytest.mark.parametrize("call", ["get", "get_into", "match", "exists", "put", "delete"])
def test_client_with_wrong_token_raises_auth_error(path: Path, call: str):
    keys = random_keys(2)
    calls: dict[str, Callable[[Client], Any]] = {
        "get": lambda c: c.get(keys),
        "get_into": lambda c: c.get_into(keys, [bytearray(BLOCK) for _ in keys]),
        "match": lambda c: c.match(keys),
        "exists": lambda c: c.exists(keys),
        "put": lambda c: c.put(keys, random_blocks(2)),
        "delete": lambda c: c.delete(keys),
    }
    with connect(path, token="wrong" * 4) as client, pytest.raises(AuthError):
        calls[call](client)


# -- malformed input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["bad-magic", "bad-crc", "wrong-version"])
def test_bad_frame_header_gets_bad_frame_and_close(local: LocalCluster, admin_token: str, case: str):
    with open_raw(local) as sock:
        code, _ = PRE_AUTH_CASES[case](sock, admin_token)
        assert code == ErrorCode.BAD_FRAME
        assert_error_then_closed(sock, ErrorCode.BAD_FRAME)


@pytest.mark.parametrize("case", ["pre-auth-payload", "pre-auth-huge-meta", "huge-payload", "huge-meta"])
def test_header_over_the_limit_gets_too_large_and_close(local: LocalCluster, admin_token: str, case: str):
    with open_raw(local) as sock:
        code, _ = ALL_CASES[case](sock, admin_token)
        assert code == ErrorCode.TOO_LARGE
        assert_error_then_closed(sock, ErrorCode.TOO_LARGE)


@pytest.mark.parametrize(
    "case",
    [
        "put-lens-do-not-add-up",
        "keys-blob-wrong-length",
        "bad-key-length",
        "idx-length-mismatch",
        "shard-index-out-of-range",
        "unknown-opcode",
        "second-hello",
    ],
)
def test_malformed_request_gets_bad_request_and_close(local: LocalCluster, admin_token: str, case: str):
    with open_raw(local) as sock:
        code, rid = AUTHED_CASES[case](sock, admin_token)
        assert code == ErrorCode.BAD_REQUEST
        assert_error_then_closed(sock, ErrorCode.BAD_REQUEST, rid)


def test_metadata_not_a_map_gets_bad_frame_and_close(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        _metadata_not_a_map(sock, admin_token)
        assert_error_then_closed(sock, ErrorCode.BAD_FRAME)


def test_put_shards_with_ragged_lens_blob_gets_bad_request_and_close(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        hello(sock, admin_token)
        meta = {
            **keys_meta(random_keys(1)),
            "idx": b"\x00",
            "lens": b"\x00\x10\x00\x00\x00",  # 5 bytes: not a whole number of uint32
            "blen": np.array([4096], dtype="<u8").tobytes(),
            "cls": "chatbot",
        }
        send_frame(sock, Op.PUT_SHARDS, meta, b"s" * 4096, rid=21)
        assert_error_then_closed(sock, ErrorCode.BAD_REQUEST, 21)


def test_a_commit_that_does_not_match_its_put_is_refused_and_loses_nothing(local: LocalCluster, admin_token: str):
    put_id = os.urandom(8)
    meta = {
        **keys_meta(random_keys(2)),
        "idx": bytes([2, 3]),
        "lens": np.array([4096, 4096], dtype="<u4").tobytes(),
        "blen": np.array([40960, 40960], dtype="<u8").tobytes(),
        "cls": "chatbot",
        "put": put_id,
    }
    with open_raw(local) as sock:
        hello(sock, admin_token)
        send_frame(sock, Op.PUT_SHARDS, meta, b"s" * 8192, rid=30)
        assert recv_frame(sock).meta["st"] == bytes(2)  # OK, OK: pending
        send_frame(sock, Op.COMMIT, {"put": put_id, "act": bytes([1, 1, 1])}, rid=31)  # three shards named
        assert_error_then_closed(sock, ErrorCode.BAD_REQUEST, 31)
    with open_raw(local) as sock:
        hello(sock, admin_token)
        send_frame(sock, Op.COMMIT, {"put": put_id, "act": bytes([1, 1])}, rid=32)
        assert recv_frame(sock).meta["st"] == bytes(2)  # both committed: the bad COMMIT changed nothing


def test_garbage_longer_than_a_header_gets_bad_frame_and_close(local: LocalCluster):
    with open_raw(local) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: kvtier\r\nAccept: */*\r\n\r\n")
        assert_error_then_closed(sock, ErrorCode.BAD_FRAME)


def test_long_garbage_is_dropped_and_the_node_keeps_serving(local: LocalCluster):
    garbage = random.Random(5).randbytes(256 << 10)
    with open_raw(local) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # the node may close before the end
            sock.sendall(garbage)
        assert_closed(sock)
    assert_node_serves(local)


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_bad_connection_is_closed_and_the_node_keeps_serving(local: LocalCluster, admin_token: str, case: str):
    frames, code = run_bad(local, ALL_CASES[case], admin_token)
    assert [f.meta.get("code") for f in frames] == [code], [f.meta for f in frames]
    assert_node_serves(local)


def test_ragged_lens_blob_is_closed_and_the_node_keeps_serving(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        hello(sock, admin_token)
        meta = {**keys_meta(random_keys(1)), "idx": b"\x00", "lens": b"\x00" * 5, "blen": b"\x00" * 8, "cls": "x"}
        send_frame(sock, Op.PUT_SHARDS, meta, rid=22)
        assert_closed(sock)
    assert_node_serves(local)


def test_client_connected_before_bad_connections_keeps_working(local: LocalCluster, admin_token: str):
    with Client(local.config) as client:
        assert_round_trip(client)  # opens and authenticates connections to all 12 nodes, node 0 included
        before = client.pool.conns[TARGET].sock
        assert before is not None
        keys, blocks = random_keys(4), random_blocks(4)
        assert client.put(keys, blocks) == [True] * 4
        for case in ALL_CASES.values():
            run_bad(local, case, admin_token)
        assert client.pool.conns[TARGET].sock is before  # the very same connection, never dropped
        assert client.get(keys) == blocks
        assert client.exists(keys) == [True] * 4
        assert_round_trip(client)
        assert client.pool.conns[TARGET].sock is before


def test_raw_connection_open_before_bad_connection_keeps_working(local: LocalCluster, admin_token: str):
    with open_raw(local) as good:
        hello(good, admin_token)
        run_bad(local, _put_lens_do_not_add_up, admin_token)
        run_bad(local, _bad_magic, admin_token)
        send_frame(good, Op.MATCH, keys_meta(random_keys(2)), rid=30)
        reply = recv_frame(good)
    assert reply is not None and reply.opcode == Op.MATCH | Op.REPLY and reply.request_id == 30


# -- memory ----------------------------------------------------------------------------------------------


def test_pre_auth_hello_with_huge_meta_len_is_refused_without_allocating_it(local: LocalCluster, admin_token: str):
    before = node_rss_kib(local, TARGET)
    with open_raw(local) as sock:
        sock.sendall(raw_header(Op.HELLO, meta_len=1 << 30))  # announces 1 GiB of metadata, sends none
        frames = assert_closed(sock)
    assert [f.meta.get("code") for f in frames] == [ErrorCode.TOO_LARGE]
    after, peak = node_rss_kib(local, TARGET), node_rss_kib(local, TARGET, "VmHWM")
    assert after < before + (64 << 10), f"RSS grew from {before} KiB to {after} KiB"
    assert peak < 256 << 10, f"the node's peak RSS is {peak} KiB"
    assert_node_serves(local)


def test_authenticated_huge_meta_len_is_refused_without_allocating_it(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        hello(sock, admin_token)
        sock.sendall(raw_header(Op.MATCH, rid=2, meta_len=2**32 - 1))  # 4 GiB, limit is 8 MiB
        assert_closed(sock)
    assert node_rss_kib(local, TARGET, "VmHWM") < 256 << 10
    assert_node_serves(local)


def test_many_pre_auth_huge_announcements_do_not_grow_the_node(local: LocalCluster, admin_token: str):
    before = node_rss_kib(local, TARGET)
    for _ in range(50):
        with open_raw(local) as sock:
            sock.sendall(raw_header(Op.HELLO, meta_len=(1 << 30) + 1, payload_len=2**63))
            assert_closed(sock)
    assert node_rss_kib(local, TARGET) < before + (32 << 10)


# -- tenants ---------------------------------------------------------------------------------------------


@pytest.fixture()
def default_blocks(path: Path) -> tuple[list[bytes], list[bytes]]:
    """Blocks the default tenant stored under fresh keys."""
    keys, blocks = random_keys(4), random_blocks(4, 8 << 10)
    with connect(path) as client:
        assert client.put(keys, blocks) == [True] * 4
        assert client.match(keys) == 4
    return keys, blocks


def test_tenant_cannot_see_another_tenants_blocks(path: Path, default_blocks: tuple[list[bytes], list[bytes]]):
    keys, blocks = default_blocks
    with connect(path, token=TEAMB_TOKEN) as teamb:
        assert teamb.match(keys) == 0
        assert teamb.exists(keys) == [False] * 4
        assert teamb.get(keys) == [None] * 4
        assert teamb.get_into(keys, [bytearray(len(b)) for b in blocks]) == [False] * 4


def test_tenant_stat_shows_no_records_of_another_tenant(path: Path, default_blocks: tuple[list[bytes], list[bytes]]):
    keys, _ = default_blocks
    with connect(path) as owner, connect(path, token=TEAMB_TOKEN) as teamb:
        assert owner.stat(keys[0])["block"] is not None
        other = teamb.stat(keys[0])
    assert other["block"] is None
    assert other["shards"] == []


def test_tenant_delete_does_not_remove_another_tenants_blocks(
    path: Path, default_blocks: tuple[list[bytes], list[bytes]]
):
    keys, blocks = default_blocks
    with connect(path, token=TEAMB_TOKEN) as teamb:
        teamb.delete(keys)
    with connect(path) as owner:
        assert owner.match(keys) == 4
        assert owner.get(keys) == blocks


def test_tenants_store_their_own_data_under_the_same_keys(path: Path, default_blocks: tuple[list[bytes], list[bytes]]):
    keys, blocks = default_blocks
    theirs = random_blocks(4, 8 << 10)
    with connect(path, token=TEAMB_TOKEN) as teamb:
        assert teamb.put(keys, theirs) == [True] * 4  # not EXISTS-skipped because default has them
        assert teamb.match(keys) == 4
        assert teamb.get(keys) == theirs
    with connect(path) as owner:
        assert owner.get(keys) == blocks
        out = [bytearray(len(b)) for b in blocks]
        assert owner.get_into(keys, out) == [True] * 4
        assert out == blocks


def test_tenant_delete_removes_only_its_own_copy(path: Path, default_blocks: tuple[list[bytes], list[bytes]]):
    keys, blocks = default_blocks
    theirs = random_blocks(4, 8 << 10)
    with connect(path, token=TEAMB_TOKEN) as teamb:
        assert teamb.put(keys, theirs) == [True] * 4
        teamb.delete(keys[:2])
        assert teamb.exists(keys) == [False, False, True, True]
        assert teamb.get(keys) == [None, None, *theirs[2:]]
    with connect(path) as owner:
        assert owner.get(keys) == blocks


def test_blocks_of_a_tenant_are_invisible_to_the_default_tenant(path: Path):
    keys, blocks = random_keys(3), random_blocks(3, 4 << 10)
    with connect(path, token=TEAMB_TOKEN) as teamb:
        assert teamb.put(keys, blocks) == [True] * 3
    with connect(path) as owner:
        assert owner.match(keys) == 0
        assert owner.get(keys) == [None] * 3


# -- admin operations ------------------------------------------------------------------------------------


def test_non_admin_node_info_gets_forbidden_and_connection_stays_usable(local: LocalCluster):
    with open_raw(local) as sock:
        hello(sock, TEAMB_TOKEN)
        send_frame(sock, Op.NODE_INFO, {}, rid=40)
        error = recv_frame(sock)
        assert error is not None and error.opcode == Op.ERROR
        assert error.meta["code"] == ErrorCode.FORBIDDEN
        assert error.request_id == 40
        send_frame(sock, Op.MATCH, keys_meta(random_keys(2)), rid=41)
        reply = recv_frame(sock)
        assert reply is not None and reply.opcode == Op.MATCH | Op.REPLY and reply.request_id == 41
        assert reply.meta["live"] == b"\x00\x00"
        send_frame(sock, Op.NODE_INFO, {}, rid=42)  # still forbidden, still open
        again = recv_frame(sock)
        assert again is not None and again.meta["code"] == ErrorCode.FORBIDDEN and again.request_id == 42


def test_admin_node_info_answers_with_the_node_state(local: LocalCluster, admin_token: str):
    with open_raw(local) as sock:
        hello(sock, admin_token)
        send_frame(sock, Op.NODE_INFO, {}, rid=50)
        reply = recv_frame(sock)
    assert reply is not None and reply.opcode == Op.NODE_INFO | Op.REPLY and reply.request_id == 50
    assert reply.meta["node_id"] == TARGET
    assert reply.meta["pid"] == local.procs[TARGET].pid
    assert reply.meta["capacity_bytes"] == 256 << 20


def test_connections_beyond_the_limit_are_refused_busy_and_the_node_recovers(make_cluster) -> None:
    local = make_cluster(capacity_bytes=64 << 20, extra_toml="[limits]\nmax_connections = 2")
    node = local.config.nodes[0]
    held = [socket.create_connection((node.host, node.port), timeout=SOCKET_TIMEOUT_S) for _ in range(2)]
    for sock in held:
        hello(sock, local.config.token)  # answered: the node serves both, so both connection slots are taken
    with socket.create_connection((node.host, node.port), timeout=SOCKET_TIMEOUT_S) as extra:
        reply = FrameReader().feed(extra.recv(4096))
        assert reply and reply[0].opcode == Op.ERROR and reply[0].meta["code"] == ErrorCode.BUSY
    for sock in held:
        sock.close()

    def served() -> bool:
        with socket.create_connection((node.host, node.port), timeout=SOCKET_TIMEOUT_S) as sock:
            send_frame(sock, Op.HELLO, {"token": local.config.token}, rid=1)
            frame = recv_frame(sock)
            return frame is not None and frame.opcode == Op.HELLO | Op.REPLY

    wait_for(served, 10, "the node to free the connection slots of closed connections")
    with connect(local.config_path) as client:
        keys = [os.urandom(16)]
        assert client.put(keys, [os.urandom(4096)]) == [True]
