"""The engine against tiers that come and go: a fetcher restarted, down, not yet started, or unable to stage its
blocks; a store that goes away and comes back. Real node, fetcher and worker processes."""

from __future__ import annotations

import logging
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine.engine import Engine
from kvtier.engine.stateblocks import LocalStateBlocks
from kvtier.engine.worker import WorkerProcess
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.transfer.fetch_client import FetchClient
from kvtier.transfer.fetcher import LocalFetcher

from .conftest import ClusterFactory, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = 1500  # tokens: with the tiny checkpoint's 64-token blocks, a hit of 1,280 tokens (20 blocks)
HIT = 1280


@pytest.fixture(scope="module")
def cluster(make_cluster: ClusterFactory) -> LocalCluster:
    return make_cluster(capacity_bytes=64 << 20)


@pytest.fixture
def fetcher(cluster: LocalCluster, tmp_path: Path) -> Iterator[LocalFetcher]:
    """A fetcher (not started) on a socket of its own: the test starts, stops and restarts it."""
    made = LocalFetcher(cluster.config_path, f"kvt-tiers-{secrets.token_hex(4)}", tmp_path / "f.sock", "8MiB")
    yield made
    made.stop()


@pytest.fixture
def engine(checkpoint: Path, cluster: LocalCluster) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(**kw: Any) -> Engine:
        made.append(
            Engine.from_pretrained(
                checkpoint, store=cluster.config_path, state_blocks=LocalStateBlocks(), cache_tokens=8192, **kw
            )
        )
        return made[-1]

    yield make
    for e in made:
        e.close()


def prompt(seed: int) -> list[int]:
    return torch.randint(0, 512, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def fetcher_stats(fetcher: LocalFetcher, cluster: LocalCluster) -> dict[str, Any]:
    with FetchClient(fetcher.socket_path, cluster.config.token) as client:
        return client.stats()


def test_the_first_request_after_a_fetcher_restart_reuses_through_the_new_fetcher(
    engine: Callable[..., Engine], fetcher: LocalFetcher, cluster: LocalCluster
) -> None:
    fetcher.start()
    e = engine(fetcher=fetcher.socket_path)
    p = prompt(1)
    cold = e.generate([p], 4)[0]
    fetcher.stop()
    fetcher.start()  # a new process: an empty pool, and the engine's connection is dead
    warm = e.generate([p], 4)[0]
    assert (cold.hit_tokens, warm.hit_tokens, warm.tokens) == (0, HIT, cold.tokens)
    assert fetcher_stats(fetcher, cluster)["blocks_fetched"] == HIT // 64  # through the restarted fetcher
    assert e.stats()["fetcher_failed_calls"] == 0  # no call was lost to the restart


def test_while_the_fetcher_is_down_the_engine_reuses_through_its_store_client_and_says_so_once(
    engine: Callable[..., Engine], fetcher: LocalFetcher, cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    fetcher.start()
    e = engine(fetcher=fetcher.socket_path)
    p, q = prompt(2), prompt(3)
    cold = e.generate([p], 4)[0]
    fetcher.stop()
    with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
        down = [e.generate([p], 4)[0], e.generate([q], 4)[0], e.generate([q], 4)[0]]
        assert [r.hit_tokens for r in down] == [HIT, 0, HIT]  # read, and stored, through the store client
        assert down[0].tokens == cold.tokens
        assert lines(caplog, "is not answering") == 1 and lines(caplog, "answering again") == 0
        stats = e.stats()
        assert (stats["fetcher_up"], stats["fetcher_outages"], stats["fetcher_recoveries"]) == (0, 1, 0)
        # the blocks moved without it: two hits read (reads went uncounted) and q's blocks stored
        assert stats["fetcher_unstaged_blocks"] >= 2 * HIT // 64 + PROMPT // 64
        fetcher.start()
        back = e.generate([q], 4)[0]
        assert back.hit_tokens == HIT and fetcher_stats(fetcher, cluster)["blocks_fetched"] == HIT // 64
        assert lines(caplog, "is not answering") == 1 and lines(caplog, "answering again") == 1
    stats = e.stats()
    assert (stats["fetcher_up"], stats["fetcher_outages"], stats["fetcher_recoveries"]) == (1, 1, 1)


def test_an_engine_started_before_its_fetcher_says_so_in_one_line_and_uses_it_once_it_is_there(
    checkpoint: Path, fetcher: LocalFetcher, cluster: LocalCluster
) -> None:
    argv = ["--checkpoint", str(checkpoint), "--store", str(cluster.config_path), "--fetcher", str(fetcher.socket_path)]
    worker = WorkerProcess([sys.executable, "-m", "kvtier.engine.cli", "prefill", *argv])
    worker.proc = subprocess.Popen(  # (the same worker, its stderr kept)
        worker.proc.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert worker.wait_ready().ready["ready"] is True
        fetcher.start()
        p = prompt(4)
        assert "error" not in worker.ask({"id": 1, "prompt": p})
        assert worker.ask({"id": 2, "prompt": p})["hit_tokens"] == HIT
        assert fetcher_stats(fetcher, cluster)["requests"] >= 1  # it found the fetcher once it was there
    finally:
        worker.stop()
    assert worker.proc.stderr is not None
    said = worker.proc.stderr.read().strip().splitlines()
    assert len([line for line in said if "not answering" in line]) == 1, said
    assert str(fetcher.socket_path) in said[0] and "Traceback" not in "\n".join(said)


def test_blocks_the_fetcher_cannot_stage_go_through_the_store_client_and_the_reason_is_said_once(
    engine: Callable[..., Engine], cluster: LocalCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shm = f"kvt-tiers-{secrets.token_hex(4)}"
    with LocalFetcher(cluster.config_path, shm, tmp_path / "small.sock", "16KiB") as small:  # pages are 32 KiB
        e = engine(fetcher=small.socket_path)
        p = prompt(5)
        with caplog.at_level(logging.ERROR, logger="kvtier.engine"):
            cold, warm, again = e.generate([p], 4)[0], e.generate([p], 4)[0], e.generate([p], 4)[0]
        assert (cold.hit_tokens, warm.hit_tokens, again.hit_tokens) == (0, HIT, HIT)
        assert lines(caplog, "start kvtier-fetcher with a larger --size") == 1
        assert e.stats()["fetcher_unstaged_blocks"] >= 2 * HIT // 64


def test_a_store_hit_fetched_through_the_fetcher_is_a_host_hit_the_next_time(
    engine: Callable[..., Engine], fetcher: LocalFetcher, cluster: LocalCluster
) -> None:
    p = prompt(6)
    engine().generate([p], 4)  # another engine stored the blocks; the fetcher's pool holds none of them
    fetcher.start()
    e = engine(fetcher=fetcher.socket_path)
    first = e.generate([p], 4)[0]
    after_first = fetcher_stats(fetcher, cluster)
    second = e.generate([p], 4)[0]
    after_second = fetcher_stats(fetcher, cluster)
    assert first.hit_tokens == second.hit_tokens == HIT
    assert (after_first["blocks_fetched"], after_first["blocks_hit"]) == (HIT // 64, 0)  # read from the store
    assert after_second["blocks_fetched"] == HIT // 64 and after_second["blocks_hit"] == HIT // 64  # from the pool


def test_a_store_that_goes_away_and_comes_back_is_said_once_each_way_and_counted(
    checkpoint: Path, make_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    local = make_cluster(capacity_bytes=64 << 20)
    e = Engine.from_pretrained(checkpoint, store=local.config_path, state_blocks=LocalStateBlocks(), cache_tokens=8192)
    try:
        p = prompt(7)
        e.generate([p], 4)
        local.stop()
        with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
            assert [r.hit_tokens for r in e.generate([p, p], 4)] == [0, 0]
            assert lines(caplog, "the store is not answering") == 1
            assert e.stats()["store_up"] == 0 and e.stats()["store_outages"] == 1
            local.start()  # (the client tries nodes it found down again after a back-off)
            wait_for(lambda: e.generate([p], 4)[0].hit_tokens == HIT, 60, "reuse to return", poll_s=0.5)
            assert lines(caplog, "the store is answering again") == 1 and lines(caplog, "not answering") == 1
        stats = e.stats()
        assert (stats["store_up"], stats["store_outages"], stats["store_recoveries"]) == (1, 1, 1)
        assert stats["store_failed_calls"] >= 2
    finally:
        e.close()
