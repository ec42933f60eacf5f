"""StateBlocks across hosts: two host processes, a directory process, real shared memory and TCP."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.wire.transport import AuthError
from kvtier.transfer.directory import DirectoryClient, DirectoryError
from kvtier.transfer.state_protocol import Location
from kvtier.transfer.stateblock import Puller, StateBlockHost, stateblock_bytes

from .conftest import wait_for

BLOCK = stateblock_bytes(n_swa_layers=2, bytes_per_token=64)  # 17,152 B: small, same shape as the real one


def block_of(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


class Proc:
    """A child process that prints one line when ready and then answers one line per line it is sent."""

    def __init__(self, argv: list[str], stops_at_eof: bool = False) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.stops_at_eof = stops_at_eof  # else SIGTERM stops it
        self.ready = self.read()

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line, f"child exited with {self.proc.poll()}"
        return line

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        """End of input (a host closes, removing its segment) or SIGTERM; anything still running is killed."""
        if not self.stops_at_eof:
            self.proc.terminate()
        try:
            self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> cluster_mod.ClusterConfig:
    """A cluster file (no nodes need to run: StateBlocks never go to the store) with a second tenant."""
    path = cluster_mod.write_default(tmp_path_factory.mktemp("sb"), nodes=12)
    path.write_text(path.read_text() + f'\n[tenants.other]\ntoken = "{secrets.token_hex(16)}"\n')
    return cluster_mod.load(path)


def start_directory(config: cluster_mod.ClusterConfig, port: int = 0, lease: str = "30s") -> tuple[Proc, int]:
    assert config.path is not None
    argv = [sys.executable, "-m", "kvtier.transfer.directory", "--config", str(config.path)]
    proc = Proc([*argv, "--listen", f"127.0.0.1:{port}", "--lease", lease])
    return proc, int(proc.ready.rsplit(":", 1)[1])


@pytest.fixture
def directory(config: cluster_mod.ClusterConfig) -> Iterator[int]:
    proc, port = start_directory(config)
    yield port
    proc.stop()


def start_host(
    config: cluster_mod.ClusterConfig, directory_port: int, capacity: int = 4 * BLOCK, shm: str = ""
) -> Proc:
    """Host A, its own process: ``put HEXKEY SEED`` puts a StateBlock and answers its slot and generation."""
    shm = shm or f"kvt-test-{secrets.token_hex(6)}"
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from kvtier.kvstore.cluster import config as cluster
        from kvtier.transfer.stateblock import StateBlockHost
        host = StateBlockHost(cluster.load({str(config.path)!r}), {shm!r}, {capacity},
                              {BLOCK}, "host-a", directory=("127.0.0.1", {directory_port}), heartbeat_s=0.1)
        print("ready", flush=True)
        for line in sys.stdin:
            key, seed = line.split()
            data = np.random.default_rng(int(seed)).integers(0, 256, {BLOCK}, dtype=np.uint8)
            assert host.put(bytes.fromhex(key), data)
            slot = host.pool.lookup(host.tid, bytes.fromhex(key))
            print(slot, int(host.pool.gen[slot]), flush=True)
        host.close()
        """
    )
    return Proc([sys.executable, "-c", code], stops_at_eof=True)


@pytest.fixture
def host_b(config: cluster_mod.ClusterConfig, directory: int) -> Iterator[StateBlockHost]:
    host = StateBlockHost(
        config, f"kvt-test-{secrets.token_hex(6)}", 4 * BLOCK, BLOCK, "host-b", directory=("127.0.0.1", directory)
    )
    yield host
    host.close()


def test_a_stateblock_put_on_one_host_is_pulled_by_another(config, directory: int, host_b: StateBlockHost) -> None:
    host_a = start_host(config, directory)
    try:
        key = secrets.token_bytes(16)
        host_a.ask(f"{key.hex()} 1")
        out = bytearray(BLOCK)
        assert host_b.get_into(key, out)
        assert bytes(out) == block_of(1).tobytes()
        assert not host_b.get_into(secrets.token_bytes(16), out)  # nobody holds it: a miss
    finally:
        host_a.stop()


def test_pulling_a_reused_slot_is_a_miss_never_other_bytes(config, directory: int, host_b: StateBlockHost) -> None:
    host_a = start_host(config, directory, capacity=BLOCK)  # one slot: every put reuses it
    try:
        first, second = secrets.token_bytes(16), secrets.token_bytes(16)
        slot, gen = map(int, host_a.ask(f"{first.hex()} 1").split())
        stale = host_b.locate([first])[0]
        assert stale is not None and (stale.slot, stale.generation) == (slot, gen)
        host_a.ask(f"{second.hex()} 2")
        out = bytearray(BLOCK)
        assert not host_b.puller.pull_into(stale, first, memoryview(out))
        assert not host_b.get_into(first, out)  # and the directory forgot it
        assert host_b.get_into(second, out) and bytes(out) == block_of(2).tobytes()
    finally:
        host_a.stop()


def test_a_crashed_hosts_stateblocks_are_misses_and_its_restart_serves_again(
    config, directory: int, host_b: StateBlockHost
) -> None:
    host_a = start_host(config, directory)
    key = secrets.token_bytes(16)
    host_a.ask(f"{key.hex()} 6")
    host_a.proc.kill()  # SIGKILL: its pool (private memory) goes with it; the directory still points at it
    host_a.stop()
    out = bytearray(BLOCK)
    assert not host_b.get_into(key, out)  # a miss, not an error
    restarted = start_host(config, directory)
    try:
        restarted.ask(f"{key.hex()} 7")
        wait_for(lambda: host_b.get_into(key, out), 20, "the restarted host to serve a StateBlock")
        assert bytes(out) == block_of(7).tobytes()
    finally:
        restarted.stop()


def test_a_hosts_stateblocks_are_in_no_file_another_process_could_open(config) -> None:
    before = set(os.listdir("/dev/shm"))
    with StateBlockHost(config, "kvt-test-private", 4 * BLOCK, BLOCK, "host-c") as host:
        assert host.put(secrets.token_bytes(16), block_of(1))
        assert set(os.listdir("/dev/shm")) == before


def test_a_local_stateblock_is_served_from_this_hosts_pool(host_b: StateBlockHost) -> None:
    key = secrets.token_bytes(16)
    assert host_b.put(key, block_of(3))
    out = bytearray(BLOCK)
    assert host_b.get_into(key, out) and bytes(out) == block_of(3).tobytes()
    with pytest.raises(ValueError, match="StateBlock is 17152 bytes"):
        host_b.put(key, b"short")


def test_the_lru_stateblock_is_evicted_and_forgotten_by_the_directory(host_b: StateBlockHost) -> None:
    keys = [secrets.token_bytes(16) for _ in range(host_b.pool.slots + 1)]
    for i, key in enumerate(keys):
        assert host_b.put(key, block_of(i))
    out = bytearray(BLOCK)
    assert not host_b.get_into(keys[0], out)
    assert host_b.locate(keys[:1]) == [None]
    assert all(host_b.get_into(k, out) for k in keys[1:])


def test_wrong_tokens_are_refused_by_the_stateblock_server(config, host_b: StateBlockHost) -> None:
    key = secrets.token_bytes(16)
    host_b.put(key, block_of(4))
    slot = host_b.pool.lookup(host_b.tid, key)
    assert slot is not None
    location = Location(host_b.addr, slot, int(host_b.pool.gen[slot]))
    with pytest.raises(AuthError, match="authentication failed"):
        Puller("wrong-token-wrong-token").pull_into(location, key, memoryview(bytearray(BLOCK)))
    other = Puller(config.tenants["other"])  # a valid token of another tenant: its blocks are not visible
    assert not other.pull_into(location, key, memoryview(bytearray(BLOCK)))
    mine = Puller(config.token)
    out = bytearray(BLOCK)
    assert mine.pull_into(location, key, memoryview(out)) and bytes(out) == block_of(4).tobytes()


def test_a_restarted_directory_is_rebuilt_from_the_hosts_reports(config, tmp_path: Path) -> None:
    proc, port = start_directory(config)
    host = StateBlockHost(
        config, f"kvt-test-{secrets.token_hex(6)}", 4 * BLOCK, BLOCK, "host-r", directory=("127.0.0.1", port),
        heartbeat_s=0.1,
    )  # fmt: skip
    try:
        key = secrets.token_bytes(16)
        host.put(key, block_of(5))
        reader = DirectoryClient(("127.0.0.1", port), config.token)
        assert reader.lookup([key])[0] is not None
        proc.stop()
        proc, _ = start_directory(config, port)  # the reader's connection is now stale: it reconnects by itself
        wait_for(lambda: reader.lookup([key])[0] is not None, 20, "the host to re-report to the new directory")
        stats = reader.stats()
        assert (stats["hosts"], stats["entries"], stats["full_reports"]) == (1, 1, 1)
        reader.close()
    finally:
        host.close()
        proc.stop()


def test_a_put_to_a_restarted_directory_before_any_heartbeat_re_reports_everything(config) -> None:
    proc, port = start_directory(config)
    where = ("127.0.0.1", port)
    hosts = [  # heartbeats only by hand: the restarted directory hears of host-a first through a put
        StateBlockHost(
            config, f"kvt-test-{secrets.token_hex(6)}", 4 * BLOCK, BLOCK, name, directory=where, heartbeat_s=3600
        )
        for name in ("host-a", "host-b")
    ]
    try:
        old, new = secrets.token_bytes(16), secrets.token_bytes(16)
        hosts[0].put(old, block_of(1))
        proc.stop()
        proc, _ = start_directory(config, port)
        hosts[0].put(new, block_of(2))
        assert hosts[0].heartbeat() and hosts[1].heartbeat()
        out = np.empty(BLOCK, dtype=np.uint8)
        assert hosts[1].get_into(old, out) and np.array_equal(out, block_of(1))
        assert hosts[1].get_into(new, out) and np.array_equal(out, block_of(2))
    finally:
        for host in hosts:
            host.close()
        proc.stop()


def test_a_host_that_stops_heartbeating_loses_its_entries_after_the_lease(config) -> None:
    proc, port = start_directory(config, lease="0.3s")
    try:
        client = DirectoryClient(("127.0.0.1", port), config.token)
        key = secrets.token_bytes(16)
        client.register("silent", ("127.0.0.1", 9), [key], [0], [1], full=True)
        assert client.lookup([key])[0] == Location(("127.0.0.1", 9), 0, 1)
        wait_for(lambda: client.lookup([key])[0] is None, 20, "the lease to expire")
        assert client.heartbeat("silent") is False  # it must re-report
        client.close()
    finally:
        proc.stop()


def test_the_directory_refuses_wrong_tokens_and_scopes_entries_by_tenant(config, directory: int) -> None:
    with pytest.raises(AuthError, match="authentication failed"):
        DirectoryClient(("127.0.0.1", directory), "wrong-token-wrong-token").stats()
    mine = DirectoryClient(("127.0.0.1", directory), config.token)
    theirs = DirectoryClient(("127.0.0.1", directory), config.tenants["other"])
    keys = [secrets.token_bytes(16) for _ in range(3)]
    mine.register("h", ("127.0.0.1", 9), keys, [0, 1, 2], [1, 1, 1], full=True)
    assert [loc.slot if loc else None for loc in mine.lookup([*keys, b"x" * 16])] == [0, 1, 2, None]
    assert theirs.lookup(keys) == [None] * 3
    mine.close()
    theirs.close()


def test_connections_beyond_the_limit_are_answered_busy(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, nodes=12)
    path.write_text(path.read_text() + "\n[limits]\nmax_connections = 2\n")
    config = cluster_mod.load(path)
    proc, port = start_directory(config)
    try:
        first, second = (DirectoryClient(("127.0.0.1", port), config.token) for _ in range(2))
        assert first.stats()["hosts"] == second.stats()["hosts"] == 0
        third = DirectoryClient(("127.0.0.1", port), config.token)
        with pytest.raises(DirectoryError, match="too many connections"):
            third.stats()
        first.close()
        wait_for(lambda: _answers(third), 20, "a connection to be given back")
        second.close()
        third.close()
    finally:
        proc.stop()


def _answers(client: DirectoryClient) -> bool:
    try:
        return client.stats()["hosts"] == 0
    except DirectoryError:
        return False


def test_a_directory_that_goes_away_and_comes_back_is_said_once_each_way_and_counted(
    config, caplog: pytest.LogCaptureFixture
) -> None:
    proc, port = start_directory(config)
    with caplog.at_level(logging.WARNING, logger="kvtier.stateblock"):
        host = StateBlockHost(
            config, "kvt-test-dir", 4 * BLOCK, BLOCK, "host-d", directory=("127.0.0.1", port), heartbeat_s=0.05
        )
        try:
            proc.stop()
            wait_for(lambda: host.directory_availability.failed_calls >= 5, 20, "heartbeats to find it away")
            assert host.locate([secrets.token_bytes(16)]) == [None]  # a miss, not an error
            proc, _ = start_directory(config, port)
            wait_for(lambda: host.directory_availability.up, 20, "a heartbeat to find it back")
            said = [r.getMessage() for r in caplog.records]
            assert sum("is not answering" in m for m in said) == 1, said
            assert sum("is answering again" in m for m in said) == 1, said
            availability = host.directory_availability.stats("directory")
            assert (availability["directory_outages"], availability["directory_recoveries"]) == (1, 1)
        finally:
            host.close()
            proc.stop()
