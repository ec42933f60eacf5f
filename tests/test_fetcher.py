"""The fetcher process and its clients: real node processes, a real fetcher process, real shared memory."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.wire.protocol import Op, encode_head
from kvtier.kvstore.wire.transport import AuthError
from kvtier.tools.benchutil import free_port
from kvtier.transfer.fetch_client import AsyncFetchClient, FetchClient, FetcherError
from kvtier.transfer.fetch_protocol import BlockStatus
from kvtier.transfer.fetcher import LocalFetcher

from .conftest import ClusterFactory, wait_for
from .rawwire import raw_map

BLOCK = 16 << 10


OTHER_TOKEN = secrets.token_hex(16)


@pytest.fixture(scope="module")
def cluster(make_cluster: ClusterFactory) -> LocalCluster:
    return make_cluster(capacity_bytes=32 << 20, extra_toml=f'[tenants.other]\ntoken = "{OTHER_TOKEN}"')


@pytest.fixture
def start_fetcher(cluster: LocalCluster, tmp_path: Path) -> Iterator[Callable[..., LocalFetcher]]:
    """``start_fetcher(size="1MiB")``: a fetcher process of its own; stopped and its segment removed after."""
    started: list[LocalFetcher] = []
    shm = f"kvt-test-{secrets.token_hex(6)}"

    def start(size: str = "1MiB") -> LocalFetcher:
        fetcher = LocalFetcher(cluster.config_path, shm, tmp_path / "fetcher.sock", size, f"{BLOCK}B").start()
        started.append(fetcher)
        return fetcher

    yield start
    for fetcher in started:
        fetcher.stop()


def stored_blocks(cluster: LocalCluster, n: int) -> tuple[list[bytes], list[np.ndarray]]:
    keys = [secrets.token_bytes(16) for _ in range(n)]
    blocks = [np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(n)]
    with Client(cluster.config) as client:
        assert all(client.put(keys, blocks))
    return keys, blocks


def get_requests(cluster: LocalCluster) -> int:
    """GET_SHARDS requests all nodes have served, from their /metrics."""
    total = 0
    for node in cluster.config.nodes.values():
        with urllib.request.urlopen(f"http://{node.host}:{node.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        found = re.search(r'kvtier_node_requests_total\{op="GET_SHARDS"\} (\S+)', text)
        assert found is not None
        total += int(float(found.group(1)))
    return total


def test_fetched_blocks_are_the_stored_bytes_viewed_in_place_and_read_only(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher()
    keys, blocks = stored_blocks(cluster, 6)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client, client.fetch(keys, BLOCK) as got:
        assert [b.status for b in got] == [BlockStatus.FETCHED] * 6
        for block, expected in zip(got, blocks, strict=True):
            assert np.array_equal(block.array(), expected)
            assert block.tensor().numpy().tobytes() == expected.tobytes()
        assert got[0].view().obj is got.segment.buffer.obj  # the slot itself, no copy
        with pytest.raises(ValueError, match="read-only"):
            got[0].array()[0] ^= 1
        with pytest.raises(TypeError, match=r"readonly|read-only"):
            got[0].view()[0] = 0


def test_a_second_fetch_is_a_host_memory_hit_and_contacts_no_node(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys, blocks = stored_blocks(cluster, 4)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        with client.fetch(keys, BLOCK) as first:
            assert all(b.status == BlockStatus.FETCHED for b in first)
        before = get_requests(cluster)
        with client.fetch(keys, BLOCK) as again:
            assert [b.status for b in again] == [BlockStatus.HIT] * 4
            assert all(np.array_equal(b.array(), x) for b, x in zip(again, blocks, strict=True))
        assert get_requests(cluster) == before
        stats = client.stats()
        assert stats["hits"] == 4 and stats["misses"] == 4 and stats["hit_ratio"] == 0.5


def test_a_release_sent_without_waiting_is_served_before_the_clients_next_request(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher()
    keys, _ = stored_blocks(cluster, 3)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        client.release_later(client.fetch(keys, BLOCK))
        client.release_later(client.fetch(keys[:2], BLOCK))  # two replies owed, read before the next one's
        assert client.stats()["pinned"] == 0


def test_a_release_whose_connection_died_meanwhile_costs_the_next_request_nothing(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher()
    keys, _ = stored_blocks(cluster, 2)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        got = client.fetch(keys, BLOCK)
        fetcher.stop()  # the pins go with the fetcher
        client.release_later(got)
        fetcher = start_fetcher()
        again = client.fetch(keys, BLOCK)  # on a new connection to the new fetcher
        assert again.ok().all() and client.stats()["pinned"] == 2


def test_a_fetchs_answers_as_arrays_match_its_blocks_and_release_their_pins(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher()
    keys, blocks = stored_blocks(cluster, 3)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        got = client.fetch([*keys, secrets.token_bytes(16)], BLOCK)
        assert got.status.tolist() == [BlockStatus.FETCHED] * 3 + [BlockStatus.MISS]
        assert got.ok().tolist() == got.valid().tolist() == [True, True, True, False]
        assert got.leading(got.ok()) == 3
        rows = got.segment
        for slot, expected in zip(got.slots[:3].tolist(), blocks, strict=True):
            assert np.array_equal(np.frombuffer(rows.view(slot, BLOCK), np.uint8), expected)
        assert client.stats()["pinned"] == 3
        assert client.release(got) == 3  # from the arrays: no Block object was made
        assert client.stats()["pinned"] == 0 and client.release(got) == 0  # nothing is released twice
        again = client.fetch(keys, BLOCK)
        assert [(b.slot, b.generation, b.status) for b in again] == list(
            zip(again.slots.tolist(), again.generations.tolist(), [BlockStatus.HIT] * 3, strict=True)
        )
        assert client.release(again[1:]) == 2 and client.release(again) == 1  # the Blocks now hold the pins


def test_a_miss_is_an_answer_and_leaves_no_slot_behind(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys, _ = stored_blocks(cluster, 1)
    unknown = secrets.token_bytes(16)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        got = client.fetch([unknown, *keys], BLOCK)
        assert [b.status for b in got] == [BlockStatus.MISS, BlockStatus.FETCHED]
        assert not got[0].ok and not got[0].valid()
        client.release(got)
        stats = client.stats()
        assert (stats["filling"], stats["pinned"], stats["ready"]) == (0, 0, 1)


def test_concurrent_requests_for_a_block_share_one_store_read(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys, blocks = stored_blocks(cluster, 8)

    async def both() -> tuple[list, list, dict]:
        client = await AsyncFetchClient.connect(fetcher.socket_path, cluster.config.token)
        a, b = await asyncio.gather(client.fetch(keys, BLOCK), client.fetch(keys[::-1], BLOCK))
        ok = [np.array_equal(x.array(), y) for x, y in zip(a, blocks, strict=True)]
        ok += [np.array_equal(x.array(), y) for x, y in zip(b, blocks[::-1], strict=True)]
        await client.release(a)
        await client.release(b)
        stats = await client.stats()
        await client.close()
        return ok, [x.status for x in a + b], stats

    ok, statuses, stats = asyncio.run(both())
    assert all(ok) and all(s in (BlockStatus.FETCHED, BlockStatus.HIT) for s in statuses)
    assert stats["blocks_fetched"] == 8 and stats["pinned"] == 0


async def stats_until(client: AsyncFetchClient, condition: Callable[[dict], bool]) -> None:
    """Poll the fetcher's stats until ``condition`` holds (deadline 20 s)."""
    deadline = time.monotonic() + 20
    while not condition(await client.stats()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_fetches_go_before_prefetches_and_lift_the_prefetch_they_wait_for(cluster: LocalCluster, tmp_path) -> None:
    shm = f"kvt-test-{secrets.token_hex(6)}"
    warm, running, early, lifted = (stored_blocks(cluster, 2)[0] for _ in range(4))
    order: list[str] = []

    async def scenario(client: AsyncFetchClient) -> None:
        def track(name: str, coro) -> asyncio.Task:
            task = asyncio.ensure_future(coro)
            task.add_done_callback(lambda _: order.append(name))
            return task

        await client.release(await client.fetch(warm, BLOCK))  # the segment is mapped before the race: a reply
        # that must first map it would finish late for a reason other than its priority
        for proc in cluster.procs.values():  # the one worker is stuck on the first read until the nodes resume
            proc.send_signal(signal.SIGSTOP)
        try:
            tasks = [track("running", client.fetch(running, BLOCK))]
            await stats_until(client, lambda s: s["in_flight"] == 2 and s["queued_jobs"] == 0)
            tasks.append(track("early prefetch", client.prefetch(early, BLOCK)))
            tasks.append(track("lifted prefetch", client.prefetch(lifted, BLOCK)))
            await stats_until(client, lambda s: s["queued_jobs"] == 2)
            tasks.append(track("fetch", client.fetch(lifted[:1], BLOCK)))
            await stats_until(client, lambda s: s["requests"] == 4)
        finally:
            for proc in cluster.procs.values():
                proc.send_signal(signal.SIGCONT)
        results = await asyncio.gather(*tasks)
        assert all(b.ok for blocks in results for b in blocks)
        await client.close()

    with LocalFetcher(cluster.config_path, shm, tmp_path / "p.sock", "1MiB", f"{BLOCK}B", workers=1) as fetcher:
        asyncio.run(_with_async_client(fetcher, cluster, scenario))
    assert order.index("lifted prefetch") < order.index("early prefetch")
    assert order.index("fetch") < order.index("early prefetch")


def test_hits_are_answered_while_every_worker_is_in_a_store_call(cluster: LocalCluster, tmp_path: Path) -> None:
    shm = f"kvt-test-{secrets.token_hex(6)}"
    cached, first, second, third = (stored_blocks(cluster, 2)[0] for _ in range(4))

    async def scenario(client: AsyncFetchClient) -> None:
        await client.release(await client.fetch(cached, BLOCK))
        for proc in cluster.procs.values():  # store calls hang until the nodes resume
            proc.send_signal(signal.SIGSTOP)
        try:
            stuck = [asyncio.ensure_future(client.fetch(keys, BLOCK)) for keys in (first, second, third)]
            # two store calls run (--workers 2), the third waits
            await stats_until(client, lambda s: s["in_flight"] == 6 and s["queued_jobs"] == 1)
            hits = await asyncio.wait_for(client.fetch(cached, BLOCK), timeout=10)
            assert [b.status for b in hits] == [BlockStatus.HIT] * 2 and not any(t.done() for t in stuck)
            await client.release(hits)
        finally:
            for proc in cluster.procs.values():
                proc.send_signal(signal.SIGCONT)
        for blocks in await asyncio.gather(*stuck):
            assert [b.status for b in blocks] == [BlockStatus.FETCHED] * 2
        await client.close()

    with LocalFetcher(cluster.config_path, shm, tmp_path / "w.sock", "1MiB", f"{BLOCK}B", workers=2) as fetcher:
        asyncio.run(_with_async_client(fetcher, cluster, scenario))


async def _with_async_client(fetcher: LocalFetcher, cluster: LocalCluster, scenario) -> None:
    await scenario(await AsyncFetchClient.connect(fetcher.socket_path, cluster.config.token))


def test_blocks_written_into_slots_are_stored_from_there_and_cached(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys = [secrets.token_bytes(16) for _ in range(3)]
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        slots = client.alloc(3, BLOCK)
        assert all(b.status == BlockStatus.ALLOCATED for b in slots)
        for i, block in enumerate(slots):
            block.array()[:] = i + 1
        assert client.put(keys, slots) == [True] * 3
        with Client(cluster.config) as store:
            assert [bytes(b) for b in store.get(keys)] == [bytes([i + 1]) * BLOCK for i in range(3)]
        with client.fetch(keys, BLOCK) as again:
            assert [b.status for b in again] == [BlockStatus.HIT] * 3


def test_a_put_with_an_unknown_ttl_class_is_refused_and_keeps_the_slots(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys = [secrets.token_bytes(16)]
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        slots = client.alloc(1, BLOCK)
        slots[0].array()[:] = 7
        assert client.put(keys, slots, ttl_class="forever") == [False]
        assert "unknown TTL class 'forever'" in slots[0].error and slots[0].status == BlockStatus.ALLOCATED
        assert client.put(keys, slots, ttl_class="agent") == [True]


def test_blocks_land_in_the_smallest_size_class_they_fit(cluster: LocalCluster, tmp_path: Path) -> None:
    shm = f"kvt-test-{secrets.token_hex(6)}"
    small_keys = [secrets.token_bytes(16) for _ in range(2)]
    small = [np.full(4096, i + 1, np.uint8) for i in range(2)]
    with Client(cluster.config) as store:
        assert all(store.put(small_keys, small))
    big_keys, big = stored_blocks(cluster, 2)
    classes = f"4KiB,{BLOCK}B"
    with (
        LocalFetcher(cluster.config_path, shm, tmp_path / "c.sock", "256KiB", classes) as fetcher,
        FetchClient(fetcher.socket_path, cluster.config.token) as client,
    ):
        with client.fetch(small_keys, 4096) as a, client.fetch(big_keys, BLOCK) as b:
            assert (a.segment.slot_bytes, b.segment.slot_bytes) == (4096, BLOCK)
            assert {x.segment for x in a} == {a.seg} and {x.segment for x in b} == {b.seg} and a.seg != b.seg
            assert all(np.array_equal(x.array(), y) for x, y in zip([*a, *b], [*small, *big], strict=True))
            assert client.stats()["pinned"] == 4
        stats = client.stats()
        assert (stats["pinned"], stats["ready"], stats["slot_sizes"]) == (0, 4, [4096, BLOCK])
        with client.fetch(small_keys, 3000) as smaller:  # smaller blocks take the smallest class that holds them
            assert smaller.segment is a.segment


def test_a_full_pool_answers_full_for_the_blocks_it_cannot_place(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher(size=f"{4 * BLOCK}B")  # two tenants: two slots each
    keys, _ = stored_blocks(cluster, 3)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client, client.fetch(keys, BLOCK) as got:
        assert sorted(b.status for b in got) == [BlockStatus.FETCHED, BlockStatus.FETCHED, BlockStatus.FULL]


def test_wrong_tokens_are_refused_and_the_socket_is_owner_only(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    assert stat.S_IMODE(os.stat(fetcher.socket_path).st_mode) == 0o600
    with pytest.raises(AuthError, match="authentication failed"):
        FetchClient(fetcher.socket_path, "not-the-token-at-all")
    with pytest.raises(AuthError, match="authentication failed"):
        asyncio.run(AsyncFetchClient.connect(fetcher.socket_path, "not-the-token-at-all"))
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        assert client.stats()["sessions"] == 1


def test_a_malformed_request_costs_its_connection_only(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(fetcher.socket_path))
        raw.sendall(encode_head(Op.HELLO, 0, {"token": cluster.config.token}))
        raw.recv(4096)
        raw.sendall(encode_head(32, 1, {"keys": b"short", "klen": 16, "length": BLOCK, "prio": 0}))
        raw.settimeout(5)
        reply = raw.recv(4096)
        assert reply[5] == Op.ERROR and b"whole number of keys" in reply
        assert raw.recv(4096) == b""
    with socket.socket(socket.AF_UNIX) as raw:  # requests carry no payload: announcing 1 GiB is refused at once
        raw.connect(str(fetcher.socket_path))
        raw.sendall(encode_head(Op.HELLO, 0, {"token": cluster.config.token}, payload_len=1 << 30))
        raw.settimeout(5)
        reply = raw.recv(4096)
        assert reply[5] == Op.ERROR and b"exceeds 0" in reply
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        assert client.stats()["sessions"] == 1


def test_a_tenant_never_gets_another_tenants_blocks_from_the_pool(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys, _ = stored_blocks(cluster, 2)
    with FetchClient(fetcher.socket_path, cluster.config.token) as owner:
        owner.release(owner.fetch(keys, BLOCK))
    with FetchClient(fetcher.socket_path, OTHER_TOKEN) as other, other.fetch(keys, BLOCK) as got:
        assert [b.status for b in got] == [BlockStatus.MISS] * 2


def test_an_engine_that_dies_gives_its_pins_and_slots_back(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys, _ = stored_blocks(cluster, 3)
    engine = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                from kvtier.transfer.fetch_client import FetchClient
                client = FetchClient({str(fetcher.socket_path)!r}, {cluster.config.token!r})
                blocks = client.fetch({keys!r}, {BLOCK})
                filling = client.alloc(2, {BLOCK})
                print(sum(b.ok for b in blocks + filling), flush=True)
                input()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert engine.stdout is not None and engine.stdout.readline().strip() == "5"
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        assert (client.stats()["pinned"], client.stats()["allocated"]) == (3, 2)
        engine.send_signal(signal.SIGKILL)
        engine.communicate()
        wait_for(lambda: client.stats()["pinned"] == 0, 20, "the dead engine's pins to be dropped")
        stats = client.stats()
        assert (stats["ready"], stats["allocated"], stats["free"]) == (3, 0, stats["slots"] - 3)


def test_pins_of_a_dead_engine_whose_socket_lives_on_in_a_child_are_reclaimed(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher()
    keys, _ = stored_blocks(cluster, 2)
    code = f"""
import os, time
from kvtier.transfer.fetch_client import FetchClient
client = FetchClient({str(fetcher.socket_path)!r}, {cluster.config.token!r})
blocks = client.fetch({keys!r}, {BLOCK})
child = os.fork()
if child == 0:
    os.closerange(0, 3)  # not the test's pipes: only the inherited connection stays open
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
input()
"""
    engine = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert engine.stdout is not None
    orphan = int(engine.stdout.readline())
    try:
        with FetchClient(fetcher.socket_path, cluster.config.token) as client:
            assert client.stats()["pinned"] == 2
            engine.send_signal(signal.SIGKILL)
            engine.communicate()
            wait_for(lambda: client.stats()["pinned"] == 0, 20, "the dead engine's pins to be reclaimed by pid")
    finally:
        os.kill(orphan, signal.SIGKILL)


def test_a_fetcher_killed_mid_fetch_fails_the_call_and_a_restarted_one_serves(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher()
    keys, blocks = stored_blocks(cluster, 5)
    client = FetchClient(fetcher.socket_path, cluster.config.token)
    outcome: list[object] = []
    for proc in cluster.procs.values():  # the nodes stop answering: the fetch stays in flight
        proc.send_signal(signal.SIGSTOP)
    try:
        callers = [
            threading.Thread(target=lambda: outcome.append(_fetch_or_error(client, keys))),
            threading.Thread(target=lambda: outcome.append(asyncio.run(_async_fetch_or_error(fetcher, cluster, keys)))),
        ]
        for caller in callers:
            caller.start()
        with FetchClient(fetcher.socket_path, cluster.config.token) as observer:
            wait_for(lambda: (observer.stats()["requests"], observer.stats()["in_flight"]) == (2, 5), 20, "fetches")
        fetcher.kill()
        for caller in callers:
            caller.join(30)
    finally:
        for proc in cluster.procs.values():
            proc.send_signal(signal.SIGCONT)
    assert len(outcome) == 2 and all(isinstance(o, FetcherError) for o in outcome), outcome
    restarted = start_fetcher()
    with FetchClient(restarted.socket_path, cluster.config.token) as fresh:
        stats = fresh.stats()
        assert (stats["filling"], stats["pinned"], stats["free"]) == (0, 0, stats["slots"])
    with client.fetch(keys, BLOCK) as got:  # the engine's client reconnects by itself
        assert [b.status for b in got] == [BlockStatus.FETCHED] * 5
        assert all(np.array_equal(b.array(), x) for b, x in zip(got, blocks, strict=True))
    client.close()


async def _async_fetch_or_error(fetcher: LocalFetcher, cluster: LocalCluster, keys: list[bytes]) -> object:
    client = await AsyncFetchClient.connect(fetcher.socket_path, cluster.config.token)
    try:
        return await client.fetch(keys, BLOCK)
    except Exception as exc:  # the assertion says which, if not the FetcherError expected
        return exc


def _fetch_or_error(client: FetchClient, keys: list[bytes]) -> object:
    try:
        return client.fetch(keys, BLOCK)
    except FetcherError as exc:
        return exc


def test_fetcher_status_command_shows_usage_hits_and_in_flight(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys, _ = stored_blocks(cluster, 2)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        client.release(client.fetch(keys, BLOCK))
        client.release(client.fetch(keys, BLOCK))
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.transfer.fetcher", "status", "--config", str(cluster.config_path),
         "--socket", str(fetcher.socket_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "hit ratio 50.0%" in done.stdout and "2 ready" in done.stdout and "in flight 0 blocks" in done.stdout


def test_the_fetcher_serves_metrics_and_health(cluster: LocalCluster, tmp_path: Path) -> None:
    port = free_port()
    shm = f"kvt-test-{secrets.token_hex(6)}"
    extra = ["--metrics", f"127.0.0.1:{port}"]
    with LocalFetcher(cluster.config_path, shm, tmp_path / "m.sock", "1MiB", f"{BLOCK}B", extra_args=extra) as f:
        keys, _ = stored_blocks(cluster, 2)
        with FetchClient(f.socket_path, cluster.config.token) as client:
            client.release(client.fetch(keys, BLOCK))
        scrape = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {cluster.config.token}"}
        )
        with urllib.request.urlopen(scrape, timeout=5) as reply:
            text = reply.read().decode()
        assert "kvtier_fetcher_blocks_fetched_total 2.0" in text and "kvtier_fetcher_ready 2.0" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            assert reply.status == 200 and b'"status": "ok"' in reply.read()


def test_kvbench_fetch_reports_the_ratio_to_get_into(cluster: LocalCluster) -> None:
    argv = ["--config", str(cluster.config_path), "fetch", "--block-size", "64KiB", "--blocks", "4", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.kvbench", *argv, "--json"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["fetch_vs_get_into"] > 0 and result["hit1_ms"] > 0
    assert result["pool"]["hits"] == 20 and result["pool"]["evictions"] == 12  # hits: 2 rounds x 2 sets x (4 + 1)


def _serve(cluster: LocalCluster, shm: str, socket_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``kvtier-fetcher`` in the foreground; for starts that must be refused."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier.transfer.fetcher", "--config", str(cluster.config_path), "--shm", shm,
         "--size", "1MiB", "--slot-size", f"{BLOCK}B", "--socket", str(socket_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_socket_path_that_is_a_regular_file_is_refused_and_kept(cluster: LocalCluster, tmp_path: Path) -> None:
    precious = tmp_path / "cluster.toml"
    precious.write_bytes(cluster.config_path.read_bytes())
    done = _serve(cluster, f"kvt-test-{secrets.token_hex(6)}", precious)
    assert done.returncode == 2
    assert f"{precious} exists and is not a socket" in done.stderr
    assert precious.read_bytes() == cluster.config_path.read_bytes()


def test_a_fetcher_refused_a_served_socket_leaves_no_segment_behind(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    shm = f"kvt-test-{secrets.token_hex(6)}"
    done = _serve(cluster, shm, fetcher.socket_path)
    assert done.returncode == 2 and "served by a running fetcher" in done.stderr
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(shm)]


def test_an_engine_keeps_no_descriptor_of_the_segments_of_fetchers_restarted_under_it(
    cluster: LocalCluster, start_fetcher
) -> None:
    keys, _ = stored_blocks(cluster, 1)
    fetcher = start_fetcher()
    held = []
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        for _ in range(4):
            client.release(client.fetch(keys, BLOCK))  # reconnects, and maps the new fetcher's new segment
            held.append(_segments_held())
            fetcher.stop()
            fetcher = start_fetcher()
    assert held == held[:1] * 4, held


def _segments_held() -> tuple[int, int]:
    """(descriptors, mappings) of shared-memory segments this process holds: only the fetch client's (counting
    every descriptor also counts sockets the cluster's own threads open and close meanwhile). Unreachable objects
    are collected first: a segment an earlier test's objects held until the collector ran once counted here, in
    the first measurement only, on a CI machine."""
    gc.collect()
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone by now
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    with open("/proc/self/maps") as maps:
        return fds, sum("/memfd:" in line for line in maps)


# -- tenants: each sees, reads and writes only its own part of the pool ------------------------------------


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_a_tenant_can_neither_see_read_nor_write_another_tenants_blocks(cluster: LocalCluster, start_fetcher) -> None:
    """The attack of issue 20: bob, sharing alice's fetcher, looks for alice's keys and tenant id in what he maps,
    reads her blocks' bytes, and tries to overwrite one; alice's next fetch must give her own bytes."""
    before = _shm_names()
    fetcher = start_fetcher(size="4MiB")
    keys, blocks = stored_blocks(cluster, 64)
    from kvtier.transfer.staging import tenant_id

    with FetchClient(fetcher.socket_path, cluster.config.token) as alice:
        with alice.fetch(keys, BLOCK) as got:
            assert (got.status == BlockStatus.FETCHED).all()
            alices_segment = got.seg
        assert _shm_names() == before  # nothing anyone could open by name
        with FetchClient(fetcher.socket_path, OTHER_TOKEN) as bob:
            mine = secrets.token_bytes(16)
            with Client(cluster.config, token=OTHER_TOKEN) as store:
                assert store.put([mine], [np.full(BLOCK, 7, np.uint8)]) == [True]
            with bob.fetch([mine, *keys], BLOCK) as his:  # alice's keys: misses for bob, from the pool and the store
                assert his.status.tolist() == [BlockStatus.FETCHED] + [BlockStatus.MISS] * 64
                assert his.seg != alices_segment
            everything = b"".join(bytes(region.buffer) for region in bob.segments.values())
            assert not any(k in everything for k in keys)  # no key of alice's in anything bob maps
            assert tenant_id("default").to_bytes(8, "little") not in everything  # nor her tenant id
            assert not any(b[:64].tobytes() in everything for b in blocks)  # nor her blocks' bytes
            for region in bob.segments.values():
                assert np.frombuffer(region.buffer, np.uint8).flags.writeable is False
            with pytest.raises(FetcherError, match="refused to map"):  # bob names alice's segment
                bob._map([alices_segment])
            meta, fds = raw_map(fetcher.socket_path, OTHER_TOKEN, [alices_segment])
            assert fds == [] and b"no segments" in json.dumps(meta).encode()
            assert bob.release([]) == 0 and bob.stats()["ready"] == 1  # bob's stats count bob's blocks only
        with alice.fetch(keys, BLOCK) as again:
            assert (again.status == BlockStatus.HIT).all()
            assert all(np.array_equal(b.array(), x) for b, x in zip(again, blocks, strict=True))


def test_a_cache_segments_descriptor_can_never_map_writable(cluster: LocalCluster, start_fetcher) -> None:
    import ctypes
    import mmap

    fetcher = start_fetcher()
    keys, blocks = stored_blocks(cluster, 2)
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        with client.fetch(keys, BLOCK) as got:
            segment = got.segment
            meta, fds = raw_map(fetcher.socket_path, cluster.config.token, [got.seg])
        assert len(fds) == 1 and meta["segs"][0][1] == "cache"
        fd = fds[0]
        libc = ctypes.CDLL(None, use_errno=True)
        size = os.fstat(fd).st_size
        try:
            with pytest.raises(PermissionError):  # the descriptor is read-only
                mmap.mmap(fd, size)
            address = np.frombuffer(segment.buffer, np.uint8).ctypes.data
            assert libc.mprotect(ctypes.c_void_p(address), 4096, 3) == -1  # PROT_READ | PROT_WRITE refused
            writable = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # reopened read-write: the seal still holds
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(writable, size)
                with pytest.raises(PermissionError):
                    os.pwrite(writable, b"bob", segment.data_offset)
                with pytest.raises(PermissionError):
                    os.ftruncate(writable, 0)
                punch = libc.fallocate(writable, 0x01 | 0x02, ctypes.c_long(0), ctypes.c_long(size))  # PUNCH_HOLE
                assert punch == -1 and ctypes.get_errno() == 1  # EPERM
            finally:
                os.close(writable)
        finally:
            os.close(fd)
        with client.fetch(keys, BLOCK) as again:
            assert all(np.array_equal(b.array(), x) for b, x in zip(again, blocks, strict=True))


def test_a_put_caches_what_it_stored_whatever_the_engine_writes_after(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys = [secrets.token_bytes(16)]
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        slots = client.alloc(1, BLOCK)
        assert slots.segment is not None and slots.segment.writable
        slots[0].array()[:] = 5
        assert client.put(keys, slots) == [True]
        slots.segment.view(slots[0].slot)[:] = bytes([9]) * BLOCK  # the outbox slot, written after the put
        with client.fetch(keys, BLOCK) as got:
            assert got[0].status == BlockStatus.HIT and (got[0].array() == 5).all()
        with Client(cluster.config) as store:
            assert bytes(store.get(keys)[0]) == bytes([5]) * BLOCK


# -- blocks of any size ---------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [2 << 20, (3 << 20) + 1])
def test_a_block_larger_than_every_declared_class_gets_a_class_of_its_size(
    cluster: LocalCluster, tmp_path: Path, length: int
) -> None:
    keys = [secrets.token_bytes(16) for _ in range(2)]
    data = [np.random.default_rng(i).integers(0, 256, length, dtype=np.uint8) for i in range(2)]
    with Client(cluster.config) as store:
        assert store.put(keys, data) == [True, True]
    shm = f"kvt-test-{secrets.token_hex(6)}"
    with (
        LocalFetcher(cluster.config_path, shm, tmp_path / "big.sock", "32MiB", "1MiB") as fetcher,
        FetchClient(fetcher.socket_path, cluster.config.token) as client,
    ):
        with client.fetch(keys, length) as got:
            assert got.status.tolist() == [BlockStatus.FETCHED] * 2
            assert got.segment.slot_bytes == -(-length // 4096) * 4096
            assert all(np.array_equal(b.array(), x) for b, x in zip(got, data, strict=True))
        with client.fetch(keys, length) as again:  # cached: the second request is a host-memory hit
            assert again.status.tolist() == [BlockStatus.HIT] * 2
        slots = client.alloc(1, length)
        slots[0].array()[:] = 3
        written = [secrets.token_bytes(16)]
        assert client.put(written, slots) == [True]
        with client.fetch(written, length) as put_back:
            assert put_back[0].status == BlockStatus.HIT and (put_back[0].array() == 3).all()
        assert client.stats()["slot_sizes"] == [1 << 20]  # the cluster token sees the declared classes


def test_a_block_no_share_of_the_pool_can_hold_is_answered_full_with_the_fix(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher(size="1MiB")  # two tenants: 512 KiB each
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        got = client.fetch([secrets.token_bytes(16)], 1 << 20)
        assert got.status.tolist() == [BlockStatus.FULL]
        assert "do not fit the share of tenant 'default' in the host pool" in got[0].error
        assert "start kvtier-fetcher with a larger --size" in got[0].error
        assert client.alloc(1, 1 << 20)[0].status == BlockStatus.FULL
        assert client.stats()["blocks_full"] == 2


def test_a_tenant_that_changes_block_size_gets_the_memory_of_its_idle_class(
    cluster: LocalCluster, start_fetcher
) -> None:
    fetcher = start_fetcher(size=f"{8 * BLOCK}B")  # two tenants: four blocks of BLOCK each
    small, _ = stored_blocks(cluster, 4)
    big = [secrets.token_bytes(16) for _ in range(2)]
    with Client(cluster.config) as store:
        assert store.put(big, [np.full(2 * BLOCK, i, np.uint8) for i in range(2)]) == [True, True]
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        held = client.fetch(small, BLOCK)  # the tenant's whole share, pinned
        assert client.fetch(big, 2 * BLOCK).status.tolist() == [BlockStatus.FULL] * 2  # nothing may be dropped
        client.release(held)
        with client.fetch(big, 2 * BLOCK) as got:  # the idle class is dropped for its memory
            assert got.status.tolist() == [BlockStatus.FETCHED] * 2
            assert all((b.array() == i).all() for i, b in enumerate(got))
        assert client.fetch(small[:1], BLOCK).status.tolist() == [BlockStatus.FETCHED]  # forgotten: read again


# -- a fetcher that restarts ------------------------------------------------------------------------------


def test_the_first_call_after_a_fetcher_restart_is_served(cluster: LocalCluster, start_fetcher) -> None:
    fetcher = start_fetcher()
    keys, blocks = stored_blocks(cluster, 3)

    async def fetch_async(client: AsyncFetchClient) -> list[int]:
        got = await client.fetch(keys, BLOCK)
        await client.release(got)
        return got.status.tolist()

    async def scenario() -> None:
        nonlocal fetcher
        blocking = FetchClient(fetcher.socket_path, cluster.config.token)
        client = await AsyncFetchClient.connect(fetcher.socket_path, cluster.config.token)
        blocking.release(blocking.fetch(keys, BLOCK))
        await fetch_async(client)
        fetcher.stop()
        fetcher = start_fetcher()
        with blocking.fetch(keys, BLOCK) as got:  # no Broken pipe: the dead connection is replaced at once
            assert got.status.tolist() == [BlockStatus.FETCHED] * 3
            assert all(np.array_equal(b.array(), x) for b, x in zip(got, blocks, strict=True))
        assert await fetch_async(client) == [BlockStatus.HIT] * 3
        blocking.close()
        await client.close()

    asyncio.run(scenario())
