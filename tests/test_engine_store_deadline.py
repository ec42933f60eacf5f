"""A store that hangs (its nodes stopped with SIGSTOP) never holds up the worker loop: store calls run off the
thread that steps the requests, a lookup past ``store_timeout_s`` makes its request compute its prompt instead
(logged once, counted, said in its answer), and the pages such a lookup still writes are released only once it
ends."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.engine import Engine
from kvtier.engine.worker import WorkerLoop
from kvtier.kvstore.cluster.local import LocalCluster
from tests.conftest import wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEADLINE_S = 0.5


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 37 + seed * 13) % 500 + 5 for i in range(n)]


@pytest.fixture(scope="module")
def cluster(make_cluster) -> LocalCluster:
    return make_cluster(capacity_bytes=64 << 20)


@pytest.fixture
def engine(cluster: LocalCluster, checkpoint: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(checkpoint, store=cluster.config_path) as engine:
        engine.generate([prompt(200, 0)], 1)  # connected, and the store answered once
        yield engine


@pytest.fixture
def stopped(cluster: LocalCluster) -> Iterator[None]:
    for proc in cluster.procs.values():
        proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in cluster.procs.values():
            proc.send_signal(signal.SIGCONT)


class Running:
    """A worker loop on a thread of its own, its events stamped as they come."""

    def __init__(self, engine: Engine, **kw: Any) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.loop = WorkerLoop(engine, "both", lambda e: self.events.append((time.monotonic(), e)), **kw)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def first(self, rid: Any, key: str) -> tuple[float, dict[str, Any]]:
        wait_for(lambda: any(e.get("id") == rid and key in e for _, e in self.events), 120, f"{rid}'s {key}")
        return next((t, e) for t, e in self.events if e.get("id") == rid and key in e)

    def end(self) -> None:
        self.loop.submit(None)
        self.thread.join(timeout=120)


def test_a_short_prompt_is_not_held_up_by_a_long_ones_lookup_in_a_hung_store(engine: Engine, stopped: None) -> None:
    running = Running(engine, store_timeout_s=DEADLINE_S)
    try:
        running.loop.submit({"id": "long", "prompt": prompt(700, 1), "max_new_tokens": 2})
        time.sleep(1.0)
        sent = time.monotonic()
        running.loop.submit({"id": "short", "prompt": [5, 6, 7], "max_new_tokens": 2, "stream": True})
        at, _ = running.first("short", "token")
        assert at - sent < 3.0  # (it waited ~20 s behind the lookup when the lookup ran on the loop's thread)
    finally:
        running.end()


def test_a_lookup_past_its_deadline_computes_the_prompt_and_is_said_once_and_counted(
    engine: Engine, stopped: None, caplog: pytest.LogCaptureFixture
) -> None:
    p = prompt(700, 2)
    running = Running(engine, store_timeout_s=DEADLINE_S)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
            for rid in ("a", "b"):
                running.loop.submit({"id": rid, "prompt": p, "max_new_tokens": 3})
            answers = [running.first(rid, "tokens")[1] for rid in ("a", "b")]
    finally:
        running.end()
    expected = engine.generate([p], 3, reuse=False)[0].tokens
    assert all(a["tokens"] == expected and a["hit_tokens"] == 0 and a["store_timeout"] for a in answers)
    assert running.loop.stats()["store_timeouts"] == 2
    assert len([r for r in caplog.records if "--store-timeout-ms" in r.getMessage()]) == 1


def test_pages_a_hung_lookup_still_writes_are_released_only_when_it_ends(
    engine: Engine, cluster: LocalCluster, stopped: None
) -> None:
    running = Running(engine, store_timeout_s=DEADLINE_S)
    try:
        running.loop.submit({"id": "x", "prompt": prompt(900, 3), "max_new_tokens": 2})
        running.first("x", "tokens")
        assert engine.cache.free_pages < engine.cache.num_pages  # the abandoned lookup's pages are held
        for proc in cluster.procs.values():
            proc.send_signal(signal.SIGCONT)
        wait_for(lambda: engine.cache.free_pages == engine.cache.num_pages, 120, "the lookup's pages to come back")
    finally:
        running.end()
