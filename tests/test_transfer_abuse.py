"""The transfer tier's servers under abuse (issue 20, item 3): ``kvtier-directory`` and ``kvtier-fetcher`` as real
processes started under ``ulimit -n 64`` (``prlimit``), attacked over real sockets: connections that each send a
byte and wait, HELLOs trickled a byte at a time, HELLO headers announcing megabytes, and more connections than
the process has file descriptors. The StateBlock pull servers share the directory's server loop
(``transfer.conn.serve_connections``)."""

from __future__ import annotations

import contextlib
import functools
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.wire.protocol import ErrorCode, Op, encode_head
from kvtier.transfer.directory import DirectoryClient
from kvtier.transfer.fetch_client import FetchClient
from kvtier.transfer.fetcher import LocalFetcher

from .conftest import wait_for
from .rawwire import (
    SOCKET_TIMEOUT_S,
    connect_from,
    error_code,
    hold_connections,
    raw_header,
    rss_kib,
    trickle_until_cut,
)

FD_LIMIT = ["prlimit", "--nofile=64:64"]
HELLO_TIMEOUT_S = 1.0
LIMITS = f"""
[limits]
hello_timeout_s = {HELLO_TIMEOUT_S}
max_connections = {{most}}
max_pre_auth_connections = 16
max_pre_auth_per_peer = {{per_peer}}
"""


def cluster_file(directory: Path, per_peer: int, most: int = 32) -> Path:
    path = cluster_mod.write_default(directory, capacity_bytes=64 << 20)
    path.write_text(path.read_text() + LIMITS.format(per_peer=per_peer, most=most))
    return path


# -- the directory ---------------------------------------------------------------------------------------


class Directory(NamedTuple):
    proc: subprocess.Popen[str]
    addr: tuple[str, int]
    token: str


@contextlib.contextmanager
def running_directory(folder: Path, most: int) -> Iterator[Directory]:
    """A ``kvtier-directory`` process with 64 file descriptors, taking at most ``most`` connections."""
    path = cluster_file(folder, per_peer=4, most=most)
    argv = [sys.executable, "-m", "kvtier.transfer.directory", "--config", str(path), "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen([*FD_LIMIT, *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line and line[0] == "ready", line
    host, port = line[1].rsplit(":", 1)
    try:
        yield Directory(proc, (host, int(port)), cluster_mod.load(path).token)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Directory]:
    with running_directory(tmp_path_factory.mktemp("directory"), most=32) as running:
        yield running


def test_a_hello_trickled_to_the_directory_is_cut_at_the_deadline_while_hosts_are_served(directory: Directory) -> None:
    addr, token = directory.addr, directory.token
    host = DirectoryClient(addr, token)
    try:
        assert host.register("host-a", ("127.0.0.1", 9), [b"k" * 16], [1], [1], full=True)
        with contextlib.ExitStack() as stack:
            conns = [stack.enter_context(connect_from(addr, f"127.6.0.{i // 4 + 1}")) for i in range(16)]
            took_s = trickle_until_cut(conns, encode_head(Op.HELLO, 1, {"token": token}))
            assert took_s < HELLO_TIMEOUT_S + 4.0
            assert {error_code(sock) for sock in conns} <= {ErrorCode.AUTH_REQUIRED, None}
        assert host.heartbeat("host-a")  # its connection holds a slot kept for authenticated ones
    finally:
        host.close()


def test_one_byte_connections_flooding_the_directory_from_one_address_do_not_lock_out_hosts(
    directory: Directory,
) -> None:
    addr, token = directory.addr, directory.token
    with contextlib.ExitStack() as stack:
        flood = [stack.enter_context(connect_from(addr, "127.7.0.1")) for _ in range(48)]
        for sock in flood:
            with contextlib.suppress(OSError):
                sock.send(b"K")
        host = DirectoryClient(addr, token)
        try:
            assert host.register("host-b", ("127.0.0.1", 9), [b"b" * 16], [2], [1], full=True)
            assert host.lookup([b"b" * 16])[0] is not None
        finally:
            host.close()


def test_an_oversized_pre_auth_hello_is_refused_without_growing_the_directory(directory: Directory) -> None:
    proc, addr = directory.proc, directory.addr
    before = rss_kib(proc.pid)
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(connect_from(addr, f"127.8.0.{i // 4 + 1}")) for i in range(16)]
        for sock in conns:  # 8 MiB of HELLO metadata announced, 1 KiB sent
            sock.sendall(raw_header(Op.HELLO, meta_len=8 << 20) + b"\x81" + bytes(1023))
        codes = [error_code(sock) for sock in conns]
        grown_mib = (rss_kib(proc.pid) - before) / 1024
    assert codes == [ErrorCode.TOO_LARGE] * 16
    assert grown_mib < 8, f"the directory grew by {grown_mib:.0f} MiB"


def test_the_directory_out_of_file_descriptors_keeps_running_and_accepts_once_they_free_up(tmp_path: Path) -> None:
    with running_directory(tmp_path, most=256) as directory:  # descriptors run out long before connections
        connect = functools.partial(connect_from, directory.addr)
        with hold_connections(connect, directory.token, 80) as (_held, turned_away):  # 64 descriptors in all
            assert turned_away, "the directory never ran out of descriptors"
            assert directory.proc.poll() is None, "the directory exited"
        host = DirectoryClient(directory.addr, directory.token)
        try:
            wait_for(lambda: _stats(host) is not None, 10, "the directory to accept again")
        finally:
            host.close()


def _stats(host: DirectoryClient) -> dict[str, int] | None:
    try:
        return host.stats()
    except Exception:
        return None


# -- the fetcher -----------------------------------------------------------------------------------------


class Fetcher(NamedTuple):
    local: LocalFetcher
    token: str


@pytest.fixture(scope="module")
def fetcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fetcher]:
    """A ``kvtier-fetcher`` process with 64 file descriptors (its store is never asked here)."""
    folder = tmp_path_factory.mktemp("fetcher")
    path = cluster_file(folder, per_peer=16)  # the peers here are all this test's process
    fetcher = LocalFetcher(path, f"kvt-abuse-{secrets.token_hex(4)}", folder / "fetch.sock", "4MiB", "64KiB")
    fetcher.argv = [*FD_LIMIT, *fetcher.argv]
    with fetcher:
        yield Fetcher(fetcher, cluster_mod.load(path).token)


def unix(fetcher: LocalFetcher) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(SOCKET_TIMEOUT_S)
    sock.connect(str(fetcher.socket_path))
    return sock


def test_a_hello_trickled_to_the_fetcher_is_cut_at_the_deadline_while_engines_are_served(fetcher: Fetcher) -> None:
    proc, token = fetcher
    with FetchClient(proc.socket_path, token, timeout_s=5) as engine:
        assert engine.stats()["sessions"] == 1
        with contextlib.ExitStack() as stack:
            conns = [stack.enter_context(unix(proc)) for _ in range(16)]
            took_s = trickle_until_cut(conns, encode_head(Op.HELLO, 1, {"token": token}))
        assert took_s < HELLO_TIMEOUT_S + 5.0  # (the fetcher looks for late HELLOs once a second)
        assert engine.stats()["sessions"] == 1


def test_an_oversized_pre_auth_hello_is_refused_without_growing_the_fetcher(fetcher: Fetcher) -> None:
    proc = fetcher.local
    assert proc.proc is not None
    before = rss_kib(proc.server_pid)
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(unix(proc)) for _ in range(16)]
        for sock in conns:
            sock.sendall(raw_header(Op.HELLO, meta_len=8 << 20) + b"\x81" + bytes(1023))
        codes = [error_code(sock) for sock in conns]
        grown_mib = (rss_kib(proc.server_pid) - before) / 1024
    assert codes == [ErrorCode.TOO_LARGE] * 16
    assert grown_mib < 8, f"the fetcher grew by {grown_mib:.0f} MiB"


def test_the_fetcher_out_of_file_descriptors_keeps_accepting_once_they_free_up(fetcher: Fetcher) -> None:
    proc, token = fetcher
    with hold_connections(lambda: unix(proc), token, 80) as (_held, turned_away):
        assert turned_away, "the fetcher never ran out of descriptors"

    def serves() -> bool:
        try:
            with FetchClient(proc.socket_path, token, timeout_s=2) as engine:
                return engine.stats()["sessions"] >= 1
        except Exception:
            return False

    wait_for(serves, 15, "the fetcher to accept again once descriptors are free")
