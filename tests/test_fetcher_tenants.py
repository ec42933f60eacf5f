"""Tenants of one shared fetcher as each other's adversaries (issue 36): a real cluster with tenants ``ta`` and
``tb``, a real ``kvtier-fetcher`` process, and ``tb`` doing what a well-behaved engine never would. Each test is one
attack and says what ``ta`` (and the fetcher) must still see."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import random
import secrets
import shutil
import signal
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.wire.protocol import Op, encode_head
from kvtier.kvstore.wire.transport import AuthError
from kvtier.tools.benchutil import free_port
from kvtier.transfer import fetch_protocol as fp
from kvtier.transfer.fetch_client import FetchClient, FetcherError
from kvtier.transfer.fetch_protocol import BlockStatus
from kvtier.transfer.fetcher import LocalFetcher

from .conftest import ClusterFactory, wait_for
from .rawwire import SOCKET_TIMEOUT_S, raw_map
from .test_children import _alive

BLOCK = 16 << 10
TA_TOKEN, TB_TOKEN = secrets.token_hex(32), secrets.token_hex(32)
TENANTS = f'[tenants.ta]\ntoken = "{TA_TOKEN}"\n[tenants.tb]\ntoken = "{TB_TOKEN}"\n'


@pytest.fixture(scope="module")
def cluster(make_cluster: ClusterFactory) -> LocalCluster:
    return make_cluster(capacity_bytes=64 << 20, extra_toml=TENANTS)


@pytest.fixture
def start_fetcher(cluster: LocalCluster, tmp_path: Path) -> Iterator[Callable[..., LocalFetcher]]:
    """``start_fetcher(*extra_args, config=, socket=)``: a fetcher process of its own (pool 4 MiB, 16 KiB slots; the
    cluster file and ``fetch.sock`` in the test's folder unless given); stopped after."""
    started: list[LocalFetcher] = []

    def start(*extra: str, config: Path | None = None, socket: Path | None = None) -> LocalFetcher:
        fetcher = LocalFetcher(
            config or cluster.config_path,
            f"kvt-tenants-{secrets.token_hex(4)}",
            socket or tmp_path / "fetch.sock",
            "4MiB",
            f"{BLOCK}B",
            extra_args=extra,
        )
        started.append(fetcher.start())
        return fetcher

    yield start
    for fetcher in started:
        fetcher.stop()


def stored(cluster: LocalCluster, token: str, n: int, fill: int | None = None) -> tuple[list[bytes], list[bytes]]:
    """``n`` blocks put into the store as the tenant of ``token``: (keys, bytes)."""
    keys = [secrets.token_bytes(16) for _ in range(n)]
    blocks = [bytes([fill]) * BLOCK if fill is not None else secrets.token_bytes(BLOCK) for _ in range(n)]
    with Client(cluster.config, token=token) as client:
        assert client.put(keys, blocks) == [True] * n
    return keys, blocks


def assert_served(fetcher: LocalFetcher, token: str, keys: list[bytes], blocks: list[bytes]) -> None:
    """A new engine of the tenant of ``token`` fetches ``keys`` and gets exactly ``blocks``."""
    with FetchClient(fetcher.socket_path, token, timeout_s=30) as engine, engine.fetch(keys, BLOCK) as got:
        assert got.ok().all(), got.status
        assert [bytes(b.view()) for b in got] == blocks


def outbox_descriptor(fetcher: LocalFetcher, client: FetchClient) -> tuple[int, int]:
    """(segment id, a descriptor) of the outbox ``client``'s tenant writes puts into, as MAP hands it out."""
    slots = client.alloc(1, BLOCK)
    client.release(slots)
    meta, fds = raw_map(fetcher.socket_path, client.token, [slots.seg])
    assert len(fds) == 1 and meta["segs"][0][1] == fp.OUTBOX
    return slots.seg, fds[0]


# -- sealed inputs, and a fetcher nothing a tenant does can crash (item 2) ---------------------------------------


def test_a_tenant_cannot_shrink_its_outbox_under_the_fetchers_copy(cluster: LocalCluster, start_fetcher) -> None:
    """tb truncates its own outbox to nothing and puts from it: the fetcher's copy out of the outbox used to fault
    (SIGBUS) and take every tenant's fetcher with it."""
    fetcher = start_fetcher()
    keys, blocks = stored(cluster, TA_TOKEN, 4)
    with FetchClient(fetcher.socket_path, TB_TOKEN) as tb:
        _seg, fd = outbox_descriptor(fetcher, tb)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, os.fstat(fd).st_size * 2)
        finally:
            os.close(fd)
        out = tb.alloc(2, BLOCK)
        for block in out:
            block.array()[:] = 3
        assert tb.put([secrets.token_bytes(16) for _ in out], out) == [True, True]
    assert_served(fetcher, TA_TOKEN, keys, blocks)


def _fuzz_frames(rng: random.Random, segments: list[int]) -> Iterator[bytes]:
    """Requests a hostile engine might send once authenticated: every op with out-of-range, mistyped, mismatched and
    missing fields, and garbage."""
    numbers = [0, 1, 2, 7, 255, 4096, (1 << 16) + 1, (1 << 31) - 1, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, -1]

    def number() -> int:
        return rng.choice(numbers + segments)

    def blob(n: int) -> bytes:
        return rng.randbytes(rng.choice([0, 1, 3, 8, 16, 17, n]))

    for rid in range(1, 400):
        op = rng.choice([*fp.FetchOp, 0, 1, 99, Op.ERROR])
        n = rng.choice([0, 1, 3, 1024])
        candidates = {
            "keys": rng.choice([blob(16 * n), rng.randbytes(16 * n)]),
            "klen": rng.choice([0, 16, 32, 33, 255, -1]),
            "length": number(),
            "hdr": blob(16 * n),
            "prio": number(),
            "n": number(),
            "seg": rng.choice([number(), np.array([number() % (1 << 32)] * n, "<u4").tobytes(), "x"]),
            "slot": np.array([rng.randrange(1 << 32) for _ in range(n)], "<u4").tobytes(),
            "gen": np.array([rng.randrange(1 << 63) for _ in range(n)], "<u8").tobytes(),
            "ttl": rng.choice(["chatbot", "", "nope", 7]),
            "token": TA_TOKEN,
        }
        meta = {k: v for k, v in candidates.items() if rng.random() < 0.6}
        try:
            yield encode_head(int(op) % 256, rid, meta)
        except (OverflowError, ValueError, TypeError):
            continue
        if rng.random() < 0.05:
            yield rng.randbytes(rng.randrange(1, 64))


def test_no_tenant_request_nor_outbox_abuse_crashes_the_fetcher(cluster: LocalCluster, start_fetcher) -> None:
    """A fuzzer holding tb's token: thousands of malformed and hostile requests, outbox slots written, punched and
    put twice, connections dropped mid-request. The fetcher process lives through all of it and ta's engine, there
    all along, is served throughout."""
    fetcher = start_fetcher()
    assert fetcher.proc is not None
    keys, blocks = stored(cluster, TA_TOKEN, 4)
    rng = random.Random(36)
    with (
        FetchClient(fetcher.socket_path, TA_TOKEN, timeout_s=30) as ta,
        FetchClient(fetcher.socket_path, TB_TOKEN) as tb,
    ):
        seg, fd = outbox_descriptor(fetcher, tb)
        segments = [seg, *(s for s in tb.segments), 1, 2, 3]
        for round_ in range(8):
            _abuse_outbox(fd, rng)
            with socket.socket(socket.AF_UNIX) as raw:
                raw.settimeout(SOCKET_TIMEOUT_S)
                raw.connect(str(fetcher.socket_path))
                raw.sendall(encode_head(Op.HELLO, 0, {"token": TB_TOKEN}))
                with contextlib.suppress(OSError):
                    for frame in _fuzz_frames(random.Random(round_), segments):
                        raw.sendall(frame)
            out = tb.alloc(3, BLOCK)
            if out.ok().all():  # put as they are (what the outbox's file holds of them, if anything)
                with contextlib.suppress(FetcherError, ValueError):
                    tb.put([secrets.token_bytes(16) for _ in out], out)
                with contextlib.suppress(FetcherError, ValueError):
                    tb.put([secrets.token_bytes(16) for _ in out], out)  # the same slots again: refused
            with ta.fetch(keys, BLOCK) as got:
                assert [bytes(b.view()) for b in got] == blocks
            assert fetcher.proc.poll() is None, f"the fetcher exited with {fetcher.proc.returncode}"
        os.close(fd)
    assert_served(fetcher, TA_TOKEN, keys, blocks)


def _abuse_outbox(fd: int, rng: random.Random) -> None:
    """What an engine holding its outbox's descriptor can try: shrink it, grow it, punch holes in it, write it."""
    import ctypes

    size = os.fstat(fd).st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate(fd, 0x01 | 0x02, ctypes.c_long(0), ctypes.c_long(size))  # (PUNCH_HOLE: the pages read as zeros)
    os.pwrite(fd, rng.randbytes(4096), rng.randrange(max(1, size - 4096)))
    for length in (size * 2, rng.choice([0, size // 2, 4096])):  # grown, then shrunk under the slots given out
        with contextlib.suppress(PermissionError):
            os.ftruncate(fd, length)


def test_a_fetcher_server_that_dies_is_restarted_and_the_log_says_how_it_died(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher()
    keys, blocks = stored(cluster, TA_TOKEN, 2)
    with FetchClient(fetcher.socket_path, TA_TOKEN) as ta:
        first = ta.stats()["pid"]
        os.kill(first, signal.SIGBUS)  # what a fault in its copy loop did

        def restarted() -> bool:
            with contextlib.suppress(FetcherError):
                return ta.stats()["pid"] != first
            return False

        wait_for(restarted, 30, "the fetcher's server to be restarted")
    assert_served(fetcher, TA_TOKEN, keys, blocks)
    log = fetcher.log_path.read_text()
    assert f"pid {first}" in log and "SIGBUS" in log and "restarting" in log


# -- credentials per tenant, engines of other uids (item 1) -----------------------------------------------------


def test_a_fetchers_server_ends_when_its_supervisor_is_killed(start_fetcher) -> None:
    """The server ends with its supervisor without a preexec_fn (which made subprocess fork a supervisor holding
    gRPC threads: "epoll_wait error: Bad file descriptor", and no server in test_multihost)."""
    fetcher = start_fetcher()
    assert fetcher.proc is not None and _alive(fetcher.server_pid)
    fetcher.proc.kill()
    fetcher.proc.wait()
    wait_for(lambda: not _alive(fetcher.server_pid), 10, "the server to end with its supervisor")


def test_a_fetcher_holds_no_tenants_token_and_each_engine_acts_as_its_own_tenant_only(
    cluster: LocalCluster, start_fetcher
) -> None:
    """The tb-as-ta attack: tb read the file the fetcher was given, found ta's token in it, connected as ta and put
    its own bytes under ta's keys. Now the fetcher is given the client file, which holds tokens' hashes only."""
    public = cluster_mod.write_public(cluster.config_path)
    fetcher = start_fetcher(config=public)
    given = public.read_text()
    assert not any(token in given for token in (TA_TOKEN, TB_TOKEN, cluster.config.token))
    keys, blocks = stored(cluster, TA_TOKEN, 64)
    assert_served(fetcher, TA_TOKEN, keys, blocks)
    with FetchClient(fetcher.socket_path, TB_TOKEN) as tb:
        with tb.fetch(keys, BLOCK) as got:  # ta's keys: not tb's blocks, from the pool or the store
            assert (got.status == BlockStatus.MISS).all()
        out = tb.alloc(64, BLOCK)
        for block in out:
            block.array()[:] = 0xBB
        assert tb.put(keys, out) == [True] * 64  # stored as tb's own blocks
    with FetchClient(fetcher.socket_path, TA_TOKEN) as ta, ta.fetch(keys, BLOCK) as again:
        assert (again.status == BlockStatus.HIT).all()
        assert [bytes(b.view()) for b in again] == blocks
    with pytest.raises(AuthError):
        FetchClient(fetcher.socket_path, secrets.token_hex(32))


OTHER_GROUP, ENGINE_UID, STRANGER_UID = 47360, 47361, 47362


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder other uids can reach (the test's own temporary folders are root's only)."""
    folder = Path(tempfile.mkdtemp(prefix="kvt-uids-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def become(uid: int, groups: list[int], dumpable: bool = True) -> None:
    """Turn this (forked) process into one of ``uid`` in ``groups`` (the first is its gid), as an engine that user
    started would be (``dumpable``: one exec'd by its user is; a change of uid leaves a process not)."""
    os.setgroups(groups)
    os.setgid(groups[0])
    os.setuid(uid)
    if dumpable:
        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE


def as_user(uid: int, groups: list[int], work: Callable[[], object]) -> tuple[int, object]:
    """Run ``work()`` in a forked child that :func:`become` ``uid``; (the child's pid, what ``work`` returned or the
    exception it raised), once the child has ended."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            become(uid, groups)
            result: object = work()
        except BaseException as exc:
            result = exc
        with os.fdopen(write, "wb") as out:
            pickle.dump(result, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        result = pickle.load(got)
    os.waitpid(pid, 0)
    return pid, result


def test_an_engine_of_another_uid_in_the_sockets_group_is_served_and_recorded(
    cluster: LocalCluster, start_fetcher, shared_folder: Path
) -> None:
    """The deployment the docs ask for: each tenant's engines under a uid of their own, the fetcher's socket shared
    through a group. A process outside the group cannot even connect."""
    public = cluster_mod.write_public(cluster.config_path)
    fetcher = start_fetcher("--socket-group", str(OTHER_GROUP), config=public, socket=shared_folder / "f.sock")
    keys, blocks = stored(cluster, TA_TOKEN, 4)

    def engine() -> list[bytes]:
        with FetchClient(fetcher.socket_path, TA_TOKEN) as ta, ta.fetch(keys, BLOCK) as got:
            return [bytes(b.view()) for b in got]

    pid, got = as_user(ENGINE_UID, [ENGINE_UID, OTHER_GROUP], engine)
    assert got == blocks
    _, refused = as_user(STRANGER_UID, [STRANGER_UID], engine)
    assert isinstance(refused, FetcherError) and "Permission denied" in str(refused)
    ta = cluster_mod.hashed_tenant(cluster_mod.token_hash(TA_TOKEN))  # (the client file names no tenant)
    assert f"uid {ENGINE_UID} (pid {pid}) connected as tenant {ta}" in fetcher.log_path.read_text()


def test_an_engine_holding_its_tenants_blocks_cannot_be_read_by_another_process_of_its_uid(
    cluster: LocalCluster, start_fetcher, shared_folder: Path
) -> None:
    """A process of the engine's uid used to read the blocks it mapped (and its environment) out of /proc."""
    public = cluster_mod.write_public(cluster.config_path)
    fetcher = start_fetcher("--socket-group", str(OTHER_GROUP), config=public, socket=shared_folder / "f.sock")
    keys, _ = stored(cluster, TA_TOKEN, 4)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    engine = os.fork()
    if engine == 0:  # pragma: no cover - the engine, holding ta's blocks until told to stop
        try:
            become(ENGINE_UID, [ENGINE_UID, OTHER_GROUP])
            with FetchClient(fetcher.socket_path, TA_TOKEN) as ta, ta.fetch(keys, BLOCK):
                os.write(ready_w, b"x")
                os.read(done_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"

        def peek() -> list[str]:
            refused = []
            for what in ("mem", "environ"):  # (mem: the open is the check; environ: the read)
                try:
                    with open(f"/proc/{engine}/{what}", "rb") as f:
                        f.read(1 if what == "environ" else 0)
                except PermissionError:
                    refused.append(what)
            return refused

        _, refused = as_user(ENGINE_UID, [ENGINE_UID], peek)
        assert refused == ["mem", "environ"]
    finally:
        os.write(done_w, b"x")
        os.waitpid(engine, 0)


# -- smaller items (item 5) -------------------------------------------------------------------------------------


def scrape(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_the_fetchers_metrics_tell_every_tenants_totals_to_the_admin_only(cluster: LocalCluster, start_fetcher) -> None:
    """tb scraped the fetcher's /metrics and watched ta's fetches in its totals."""
    port = free_port()
    fetcher = start_fetcher("--metrics", f"127.0.0.1:{port}")
    keys, blocks = stored(cluster, TA_TOKEN, 2)
    assert_served(fetcher, TA_TOKEN, keys, blocks)
    url = f"http://127.0.0.1:{port}"
    assert scrape(f"{url}/metrics")[0] == 401
    assert scrape(f"{url}/metrics", TB_TOKEN)[0] == 401
    status, text = scrape(f"{url}/metrics", cluster.config.token)
    assert status == 200 and "kvtier_fetcher_blocks_fetched_total 2.0" in text
    status, health = scrape(f"{url}/health")
    assert status == 200 and json.loads(health) == {"status": "ok"}
