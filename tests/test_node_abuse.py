"""Storage nodes under abuse, over real sockets to real node processes: peers that hold connections, trickle
bytes, announce megabytes, send msgpack bombs, guess tokens or use up the node's file descriptors. Each test is an
attack from issue 19 (items 5–8, 10) and says what the node must still do.

Attackers connect from addresses of their own in 127.0.0.0/8 (all of it is this machine), so the per-address
limits tell them from the clients, which connect from 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.wire.protocol import ErrorCode, Op, encode_head

from .conftest import ClusterFactory, wait_for
from .rawwire import (
    connect_from,
    error_code,
    hold_connections,
    raw_header,
    recv_frame,
    rss_kib,
    send_frame,
    trickle_until_cut,
    try_hello,
)

TEAMB_TOKEN = secrets.token_hex(16)
TARGET = 0
HELLO_TIMEOUT_S = 1.0
MAX_PRE_AUTH = 16
PER_PEER = 4
FAILURES = 5
META_BUDGET = 48 << 20  # each of the two tenants buffers at most half of it
LIMITS = f"""
[limits]
hello_timeout_s = {HELLO_TIMEOUT_S}
max_connections = 64
max_pre_auth_connections = {MAX_PRE_AUTH}
max_pre_auth_per_peer = {PER_PEER}
max_auth_failures_per_peer = {FAILURES}
auth_failure_window_s = {10 * FAILURES}
max_buffered_meta_bytes = {META_BUDGET}
"""


@pytest.fixture(scope="module")
def local(make_cluster: ClusterFactory) -> LocalCluster:
    return make_cluster(capacity_bytes=64 << 20, extra_toml=f'[tenants.teamb]\ntoken = "{TEAMB_TOKEN}"\n{LIMITS}')


def node_addr(local: LocalCluster, node_id: int = TARGET) -> tuple[str, int]:
    node = local.config.nodes[node_id]
    return node.host, node.port


def node_pid(local: LocalCluster) -> int:
    return local.procs[TARGET].pid


def attacker(n: int, subnet: int) -> str:
    """The ``n``-th of ``PER_PEER``-connection attackers, each an address of its own in 127.``subnet``.0.0/16."""
    return f"127.{subnet}.{n // 250}.{n % 250 + 1}"


def authenticated(local: LocalCluster, token: str | None = None, source_ip: str = "127.0.0.1") -> socket.socket:
    sock = connect_from(node_addr(local), source_ip)
    reply = try_hello(sock, token or local.config.token)
    assert reply is not None and reply.opcode == Op.HELLO | Op.REPLY, reply
    return sock


def match_works(sock: socket.socket, rid: int) -> bool:
    send_frame(sock, Op.MATCH, {"keys": os.urandom(32), "klen": 16}, rid=rid)
    reply = recv_frame(sock)
    return reply is not None and reply.opcode == Op.MATCH | Op.REPLY and reply.request_id == rid


def assert_round_trip(local: LocalCluster) -> None:
    """A fresh client (new connections to every node) puts and reads back."""
    keys, blocks = [os.urandom(16) for _ in range(3)], [os.urandom(8 << 10) for _ in range(3)]
    with Client(local.config) as client:
        assert client.put(keys, blocks) == [True] * 3
        assert client.get(keys) == blocks


def scraped(local: LocalCluster, name: str) -> float:
    """A series of the node's /metrics."""
    port = local.config.nodes[TARGET].metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not on /metrics")


# -- slowloris, floods and reserved slots (item 6) -------------------------------------------------------


@pytest.mark.parametrize("sent", [10, 40], ids=["mid-header", "mid-metadata"])
def test_a_connection_may_idle_between_requests_past_the_write_timeout_but_not_stall_mid_frame(
    own_cluster: ClusterFactory, sent: int
) -> None:
    quick = own_cluster(gc="write_timeout_s = 1.0\n")
    with authenticated(quick) as sock:
        time.sleep(1.5)  # idle between requests: the connection stays
        assert match_works(sock, rid=2)
        sock.sendall(encode_head(Op.MATCH, 3, {"keys": os.urandom(32), "klen": 16})[:sent])
        sock.settimeout(10.0)
        started = time.monotonic()
        assert recv_frame(sock) is None  # stalled mid-frame: closed once the write timeout passed
        assert 0.5 < time.monotonic() - started < 5.0


def test_a_hello_trickled_byte_by_byte_is_cut_at_the_deadline_while_clients_are_served(local: LocalCluster) -> None:
    hello = encode_head(Op.HELLO, 1, {"token": local.config.token})
    with Client(local.config) as client, contextlib.ExitStack() as stack:
        keys, blocks = [os.urandom(16)], [os.urandom(4 << 10)]
        assert client.put(keys, blocks) == [True]  # its connections are authenticated before the attack

        def client_served() -> None:  # while every pre-auth slot is taken
            assert client.get(keys) == blocks

        trickles = [stack.enter_context(connect_from(node_addr(local), attacker(i // PER_PEER, 1))) for i in range(16)]
        assert trickle_until_cut(trickles, hello, client_served) < HELLO_TIMEOUT_S + 4.0
        assert {error_code(sock) for sock in trickles} <= {ErrorCode.AUTH_REQUIRED, None}
    assert_round_trip(local)


def test_unauthenticated_connections_flooding_from_one_address_do_not_lock_out_clients(local: LocalCluster) -> None:
    with contextlib.ExitStack() as stack:
        flood = []
        for _ in range(100):  # each sends one byte and waits: the attack that locked out every client
            sock = stack.enter_context(connect_from(node_addr(local), "127.2.0.1"))
            with contextlib.suppress(OSError):
                sock.send(b"K")
            flood.append(sock)
        busy = 0
        for sock in flood:
            if select.select([sock], [], [], 0.5)[0] and error_code(sock) == ErrorCode.BUSY:
                busy += 1
        assert busy >= len(flood) - PER_PEER, f"only {busy} of {len(flood)} turned away"
        turned_away = scraped(local, "kvtier_node_connections_refused") + scraped(local, "kvtier_node_pre_auth_evicted")
        assert turned_away >= busy  # operators see it (each newcomer displaced the address's oldest)
        with authenticated(local) as sock:  # while the flood's admitted connections still wait
            assert match_works(sock, 2)
        assert_round_trip(local)


def test_a_pre_auth_hello_announcing_more_than_a_few_kib_is_refused_before_its_bytes(local: LocalCluster) -> None:
    with connect_from(node_addr(local), "127.3.0.1") as sock:
        sock.sendall(raw_header(Op.HELLO, meta_len=16 << 10))  # a HELLO is a few dozen bytes
        assert error_code(sock) == ErrorCode.TOO_LARGE


def test_failed_hellos_beyond_their_addresss_allowance_are_answered_late_and_good_tokens_at_once(
    local: LocalCluster,
) -> None:
    def refused_after_s(source_ip: str) -> float:
        with connect_from(node_addr(local), source_ip) as sock:
            started = time.monotonic()
            reply = try_hello(sock, "not-the-token-" + secrets.token_hex(8))
            assert reply is not None and reply.meta.get("code") == ErrorCode.AUTH_FAILED, reply
            return time.monotonic() - started

    for _ in range(FAILURES):  # the allowance (a failure's worth refills in 10 s here)
        refused_after_s("127.4.0.1")
    assert refused_after_s("127.4.0.1") >= 0.8 * HELLO_TIMEOUT_S  # held back (at most the HELLO timeout)
    with authenticated(local, source_ip="127.4.0.1") as sock:  # another client of that address: served
        assert match_works(sock, 2)


def test_pre_auth_warnings_are_rate_limited_in_the_node_log(local: LocalCluster) -> None:
    log_path = local.log_path(TARGET)
    before = log_path.read_text().count("bad magic")
    for n in range(40):  # each from an address of its own: no allowance runs out, every one is a warning
        with connect_from(node_addr(local), attacker(n, 5)) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: kvtier\r\n\r\n")
            assert error_code(sock) == ErrorCode.BAD_FRAME
    time.sleep(0.2)
    logged = log_path.read_text().count("bad magic") - before
    assert logged <= 5, f"{logged} log lines for 40 bad connections"  # at most a burst (the rest are counted)


# -- memory before payload (item 7) and the msgpack bomb (item 8) ----------------------------------------


def test_an_announced_metadata_size_is_not_allocated_before_its_bytes_arrive(local: LocalCluster) -> None:
    pid = node_pid(local)
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(authenticated(local)) for _ in range(40)]
        before = rss_kib(pid)
        for sock in socks:  # 8 MiB announced, 1 KiB sent, then silence: held until write_timeout_s
            sock.sendall(raw_header(Op.MATCH, rid=2, meta_len=8 << 20) + b"\x82" + bytes(1023))
        time.sleep(1.0)
        grown_mib = (rss_kib(pid) - before) / 1024
        assert grown_mib < 24, f"the node grew by {grown_mib:.0f} MiB for 40 × 1 KiB received"
        assert local.procs[TARGET].poll() is None


def test_metadata_buffered_by_all_connections_together_is_capped(local: LocalCluster) -> None:
    pid = node_pid(local)
    part = bytes(6 << 20)
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(authenticated(local)) for _ in range(12)]
        before = rss_kib(pid)
        for sock in socks:  # 12 × 8 MiB wanted at once, the node's budget is 32 MiB
            with contextlib.suppress(OSError):
                sock.sendall(raw_header(Op.MATCH, rid=2, meta_len=8 << 20) + b"\x82" + part)
        time.sleep(1.0)
        grown_mib = (rss_kib(pid) - before) / 1024
        refused = sum(
            1 for sock in socks if select.select([sock], [], [], 0.2)[0] and error_code(sock) == ErrorCode.BUSY
        )
    assert refused >= 12 - META_BUDGET // (8 << 20), f"{refused} of 12 refused"
    # the budget's worth (4 × 6 MiB received here), plus a little: not also the buffers each grew out of
    assert grown_mib < META_BUDGET / (1 << 20) + 8, f"the node grew by {grown_mib:.0f} MiB"
    assert_round_trip(local)


def msgpack_bomb() -> bytes:
    """STAT metadata of ~8 MiB: the key, then 127 fields of 65,536 empty arrays each (one Python list a byte)."""
    body = bytearray(b"\xde\x00\x80" + msgpack.packb("key") + msgpack.packb(os.urandom(16)))
    for i in range(127):
        body += msgpack.packb(f"k{i:03d}") + b"\xdd" + (65536).to_bytes(4, "big") + b"\x90" * 65536
    return bytes(body)


def parents_bomb() -> bytes:
    """PUT_SHARDS metadata of ~8 MiB whose ``par`` lists two million parent keys of two bytes (a Python bytes object
    each, were they built): valid field by field, but a request has at most ``max_batch`` shards."""
    fields = {"keys": os.urandom(16), "klen": 16, "idx": b"\x00", "lens": b"\x01\x00\x00\x00", "cls": "agent"}
    body = bytearray(b"\x8a" + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items()))
    body += msgpack.packb("blen") + msgpack.packb(bytes(8)) + msgpack.packb("put") + msgpack.packb(b"p" * 8)
    body += msgpack.packb("ns") + msgpack.packb(bytes(32)) + msgpack.packb("hdr") + msgpack.packb(bytes(16))
    body += msgpack.packb("par") + b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\xc4\x02pa" * 2_000_000
    return bytes(body)


def refuse_three_bombs(local: LocalCluster, opcode: Op, bomb: bytes) -> None:
    """Three connections each send ``bomb`` (metadata of ``opcode``): each is refused BAD_REQUEST at once, another
    client's MATCHes meanwhile are not held up, and the node's peak memory barely grows."""
    pid = node_pid(local)
    peak_before = rss_kib(pid, "VmHWM")
    stalls: list[float] = []
    done = threading.Event()

    def measure() -> None:
        with authenticated(local) as sock:
            rid = 10
            while not done.is_set():
                started = time.monotonic()
                assert match_works(sock, rid)
                stalls.append(time.monotonic() - started)
                rid += 1
                time.sleep(0.01)

    other = threading.Thread(target=measure)
    other.start()
    try:
        with contextlib.ExitStack() as stack:
            bombers = [stack.enter_context(authenticated(local, TEAMB_TOKEN)) for _ in range(3)]
            started = time.monotonic()
            for sock in bombers:
                sock.sendall(raw_header(opcode, rid=7, meta_len=len(bomb)) + bomb)
            codes = [error_code(sock) for sock in bombers]
            answered_s = time.monotonic() - started
    finally:
        done.set()
        other.join()
    assert codes == [ErrorCode.BAD_REQUEST] * 3
    assert answered_s < 5.0, f"three bombs took {answered_s:.1f} s to refuse"
    assert max(stalls) < 1.0, f"another client waited {max(stalls):.2f} s for a MATCH"
    grown_mib = (rss_kib(pid, "VmHWM") - peak_before) / 1024
    assert grown_mib < 96, f"the node's peak memory grew by {grown_mib:.0f} MiB decoding three 8 MiB frames"


def test_a_msgpack_bomb_is_refused_at_once_without_stalling_other_clients(local: LocalCluster) -> None:
    refuse_three_bombs(local, Op.STAT, msgpack_bomb())


def test_a_put_listing_millions_of_parents_is_refused_at_once_without_stalling_other_clients(
    local: LocalCluster,
) -> None:
    refuse_three_bombs(local, Op.PUT_SHARDS, parents_bomb())


# -- states (item 10) ------------------------------------------------------------------------------------


def test_a_put_naming_another_tenant_without_the_admin_token_is_forbidden_and_the_connection_stays(
    local: LocalCluster,
) -> None:
    key = os.urandom(16)
    meta = {
        "keys": key,
        "klen": 16,
        "idx": bytes([0]),
        "lens": np.array([4096], dtype="<u4").tobytes(),
        "blen": np.array([40960], dtype="<u8").tobytes(),
        "cls": "chatbot",
        "put": b"put-1",
        "tenant": cluster_mod.DEFAULT_TENANT,
    }
    with authenticated(local, TEAMB_TOKEN) as sock:
        send_frame(sock, Op.PUT_SHARDS, meta, b"s" * 4096, rid=3)
        reply = recv_frame(sock)
        assert reply is not None and reply.opcode == Op.ERROR, reply
        assert reply.meta["code"] == ErrorCode.FORBIDDEN and reply.request_id == 3
        assert match_works(sock, 4)  # the payload was read and dropped: the stream is in step
    with authenticated(local) as sock:
        send_frame(sock, Op.STAT, {"key": key}, rid=5)
        stat = recv_frame(sock)
    assert stat is not None and stat.meta["shards"] == [], "the forbidden PUT stored a shard"


# -- file descriptors (item 5) ---------------------------------------------------------------------------


def test_a_node_out_of_file_descriptors_keeps_running_and_serves_once_they_free_up(local: LocalCluster) -> None:
    pid = node_pid(local)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    limit = len(os.listdir(f"/proc/{pid}/fd")) + 16  # room for 16 connections, far below max_connections
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
    try:
        with hold_connections(lambda: connect_from(node_addr(local)), local.config.token, 48) as (held, turned_away):
            assert turned_away, "the node never ran out of descriptors"
            assert local.procs[TARGET].poll() is None, "the node died when it ran out of file descriptors"
            assert match_works(held[0], 9)  # connections it holds are served meanwhile
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))

    def hello_answered() -> bool:
        with connect_from(node_addr(local)) as sock:
            reply = try_hello(sock, local.config.token)
            return reply is not None and reply.opcode == Op.HELLO | Op.REPLY

    wait_for(hello_answered, 10, "the node to accept again once descriptors are free")
    assert_round_trip(local)
    node = local.config.nodes[TARGET]
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/health", timeout=5) as health:
        assert health.status == 200


# -- the metrics port (item 10) --------------------------------------------------------------------------


@pytest.fixture
def wildcard_node(tmp_path: Path) -> Iterator[cluster_mod.NodeConfig]:
    """Node 0 of a cluster file whose data address is every interface (``0.0.0.0``), as its own process."""
    path = cluster_mod.write_default(tmp_path, capacity_bytes=64 << 20)
    path.write_text(path.read_text().replace('host = "127.0.0.1"', 'host = "0.0.0.0"', 1))
    node = cluster_mod.load(path).nodes[0]
    node.data_dir.mkdir(parents=True)
    with open(node.data_dir / "node.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.gc.nodeproc", str(path), "0"], stdout=subprocess.PIPE, stderr=log
        )
    try:
        assert proc.stdout is not None and b"ready" in proc.stdout.readline()
        yield node
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_the_metrics_port_listens_on_loopback_though_the_data_port_listens_everywhere(
    wildcard_node: cluster_mod.NodeConfig,
) -> None:
    with connect_from(("127.0.0.2", wildcard_node.port)):  # data: every interface, as the file says
        pass
    with pytest.raises(ConnectionRefusedError):
        connect_from(("127.0.0.2", wildcard_node.metrics_port))
    with urllib.request.urlopen(f"http://127.0.0.1:{wildcard_node.metrics_port}/health", timeout=5) as health:
        assert health.status == 200


# -- the supervisor (item 5) -----------------------------------------------------------------------------


def next_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The next line ``proc`` prints, or "" if it prints none within ``timeout_s``."""
    assert proc.stdout is not None
    return proc.stdout.readline() if select.select([proc.stdout], [], [], timeout_s)[0] else ""


@contextlib.contextmanager
def kvstore_serve(directory: Path) -> Iterator[tuple[subprocess.Popen[str], cluster_mod.ClusterConfig]]:
    """``kvstore serve`` of a new 12-node cluster in ``directory``, once every node is ready: the process (its
    stdout to read) and the cluster; stopped with SIGTERM after, saying all its nodes stopped."""
    path = cluster_mod.write_default(directory, capacity_bytes=64 << 20)
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvtier.kvstore.cluster.cli", "serve", str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert "nodes ready" in next_line(serve, 60)
        yield serve, cluster_mod.load(path)
    finally:
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=30)
    assert "all nodes stopped" in out


def test_kvstore_serve_restarts_a_killed_node_and_the_cluster_keeps_serving(tmp_path: Path) -> None:
    with kvstore_serve(tmp_path) as (serve, config), Client(config) as client:
        pid = client.node_info([3])[3]["pid"]
        os.kill(pid, signal.SIGKILL)
        lines = [next_line(serve, 30) for _ in range(2)]
        assert lines[0].startswith("node 3 exited with code -9"), lines
        assert lines[1].startswith("node 3 restarted"), lines
        wait_for(lambda: client.node_info([3])[3].get("pid") not in (None, pid), 10, "node 3 to answer again")
        keys, blocks = [os.urandom(16) for _ in range(4)], [os.urandom(8 << 10) for _ in range(4)]
        assert client.put(keys, blocks) == [True] * 4
        assert client.get(keys) == blocks
