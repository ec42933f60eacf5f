"""The vLLM secondary tier against real local clusters.

vLLM's wheel (336 MB) is not installed by ``make test``, so the tier's logic (:class:`TierCore`) is driven by
:class:`ManagerDouble`, which calls it as vLLM 0.33.0's ``TieringOffloadingManager`` does and checks what that
manager checks: a chunk is one row of the primary view (its stride), chunk ids name rows of it, every job is
reported once and only jobs that were submitted, a partly failed load names a subset of its keys. Where vLLM
0.33.0 is installed, the last tests build :class:`KvtierTier` through vLLM's own ``SecondaryTierFactory`` and drive
it with vLLM's own ``TieringOffloadingManager`` over a real CPU primary tier.
"""

from __future__ import annotations

import os
import signal
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.adapters.store import AdapterStore, Keyspace, StoreSettings
from kvtier.adapters.vllm import Finished, TierCore, identity
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.transfer.fetcher import LocalFetcher

STRIDE = 3 * 4096  # bytes of one chunk row: deliberately not a power of two
CHUNKS = 16


def primary_view(seed: int = 0) -> tuple[np.ndarray, memoryview]:
    """A CPU primary tier as vLLM exposes it: a (chunks, row bytes) int8 array's memoryview."""
    rows = np.random.default_rng(seed).integers(-128, 128, (CHUNKS, STRIDE), dtype=np.int8)
    return rows, memoryview(rows)


class ManagerDouble:
    """Calls a TierCore as vLLM's TieringOffloadingManager calls a secondary tier, checking what it checks."""

    def __init__(self, core: TierCore) -> None:
        self.core = core
        self.jobs: dict[int, tuple[list[bytes], bool]] = {}
        self.next_job = 0
        self.reports: list[Finished] = []

    def submit(self, keys: list[bytes], chunk_ids: list[int], load: bool) -> int:
        job_id, self.next_job = self.next_job, self.next_job + 1
        self.jobs[job_id] = (keys, load)
        started = time.monotonic()
        self.core.submit(job_id, keys, np.array(chunk_ids, dtype=np.int32), load)
        assert time.monotonic() - started < 0.5  # submit_* must not do the transfer on the scheduler thread
        return job_id

    def poll(self) -> list[Finished]:
        """``_process_finished_jobs``: every report names a registered job, each job once."""
        reports = self.core.finished()
        for report in reports:
            assert report.job_id in self.jobs, f"job {report.job_id} reported but not submitted (or twice)"
            keys, load = self.jobs.pop(report.job_id)
            if report.loaded_keys is not None:
                assert load and not report.success and set(report.loaded_keys) <= set(keys)
        self.reports += reports
        return reports

    def wait(self, job_id: int, timeout_s: float = 30) -> Finished:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            found = [r for r in self.reports if r.job_id == job_id]
            if found:
                return found[0]
            time.sleep(0.01)
        raise AssertionError(f"job {job_id} was never reported")

    def lookup(self, keys: list[bytes], request: str = "req-0", steps: int = 500) -> list[bool]:
        """Look keys up step by step (RETRY: ask again after the step ends) until each is answered."""
        answers: dict[bytes, bool] = {}
        for _ in range(steps):
            for key in keys:
                if key not in answers:
                    found = self.core.lookup(key, request)
                    if found is not None:
                        answers[key] = found
            if len(answers) == len(keys):
                return [answers[k] for k in keys]
            self.core.flush_lookups()  # on_schedule_end
            time.sleep(0.01)
        raise AssertionError("lookups were never answered")


def chunk_keys(prefix: str, n: int) -> list[bytes]:
    """vLLM offload keys: a block hash and a group index."""
    return [f"{prefix}-{i}".encode().ljust(32, b".") + (0).to_bytes(4, "big") for i in range(n)]


def store_for(path: Path, **settings: Any) -> AdapterStore:
    return AdapterStore(StoreSettings.from_mapping({"config": str(path), "timeout_s": 2.0, **settings}, "test"), "test")


@pytest.fixture(scope="module")
def cluster(make_cluster) -> LocalCluster:
    return make_cluster(capacity_bytes=64 << 20)


@pytest.fixture
def tier(cluster: LocalCluster) -> Iterator[tuple[ManagerDouble, np.ndarray]]:
    rows, view = primary_view()
    core = TierCore(store_for(cluster.config_path), Keyspace({"model": "llama"}), view)
    yield ManagerDouble(core), rows
    core.shutdown()


def test_a_chunk_is_one_row_of_the_primary_view(tier: tuple[ManagerDouble, np.ndarray]) -> None:
    double, rows = tier
    assert double.core.block_size == STRIDE and double.core.chunks == CHUNKS
    keys = chunk_keys("rows", 4)
    original = rows.copy()
    assert double.wait(double.submit(keys, [0, 1, 2, 3], load=False)).success
    assert double.wait(double.submit(keys, [8, 9, 10, 11], load=True)) == (
        Finished(1, True, None, 4 * STRIDE, double.reports[-1].transfer_s)
    )
    assert np.array_equal(rows[8:12], original[0:4])
    assert np.array_equal(rows[:8], original[:8]) and np.array_equal(rows[12:], original[12:])


def test_lookups_answer_retry_until_the_step_has_ended_then_hit_or_miss(tier) -> None:
    double, _ = tier
    keys = chunk_keys("lookups", 3)
    assert double.wait(double.submit(keys[:2], [0, 1], load=False)).success
    assert [double.core.lookup(k, "req-1") for k in keys] == [None, None, None]  # not asked before the step ends
    assert double.lookup(keys, "req-1") == [True, True, False]
    double.core.request_finished("req-1")
    assert double.core._lookups == {}  # nothing kept for a finished request


def test_out_of_range_chunk_ids_fail_the_job_and_touch_nothing(tier) -> None:
    double, rows = tier
    original = rows.copy()
    report = double.wait(double.submit(chunk_keys("range", 2), [3, CHUNKS], load=True))
    assert not report.success and report.loaded_keys is None
    assert np.array_equal(rows, original)


def test_a_partly_failed_load_names_the_chunks_it_brought_and_they_are_misses_no_more(tier) -> None:
    double, rows = tier
    keys = chunk_keys("partial", 3)
    assert double.wait(double.submit(keys[:2], [0, 1], load=False)).success
    assert double.lookup(keys, "req-2") == [True, True, False]
    report = double.wait(double.submit(keys, [5, 6, 7], load=True))
    assert not report.success and report.loaded_keys == (keys[0], keys[1])
    assert np.array_equal(rows[5:7], rows[0:2])


def test_a_load_that_failed_turns_its_hits_into_misses(cluster: LocalCluster, tier) -> None:
    double, _ = tier
    keys = chunk_keys("vanished", 2)
    assert double.wait(double.submit(keys, [0, 1], load=False)).success
    assert double.lookup(keys, "req-3") == [True, True]
    double.core.store.delete(double.core.keyspace.keys(keys)[0])
    assert not double.wait(double.submit(keys, [4, 5], load=True)).success
    assert [double.core.lookup(k, "req-3") for k in keys] == [False, False]  # no promotion loop


def test_every_job_is_reported_exactly_once_and_drain_waits_for_all(tier) -> None:
    double, _ = tier
    ids = [
        double.submit(chunk_keys(f"many-{j}", 2), [2 * (j % 8), 2 * (j % 8) + 1], load=j % 2 == 1) for j in range(16)
    ]
    double.core.drain()
    double.poll()
    assert sorted(r.job_id for r in double.reports) == sorted(ids)
    assert double.jobs == {} and double.core.finished() == [] and not double.core.pending()


def test_a_hung_store_never_blocks_the_scheduler_and_fails_jobs_within_the_timeout(make_cluster) -> None:
    local = make_cluster(capacity_bytes=64 << 20)
    _, view = primary_view()
    core = TierCore(store_for(local.config_path), Keyspace({"model": "llama"}), view)
    double = ManagerDouble(core)
    keys = chunk_keys("hung", 2)
    for proc in local.procs.values():
        proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        stored, loaded = double.submit(keys, [0, 1], load=False), double.submit(keys, [2, 3], load=True)
        assert double.lookup(keys, "req-4") == [False, False]
        assert not double.wait(stored).success and not double.wait(loaded).success
        assert time.monotonic() - started < 2 * (2.0 + 1.0)  # two calls on the I/O threads, each within timeout_s
    finally:
        for proc in local.procs.values():
            proc.send_signal(signal.SIGCONT)
        core.shutdown()


def test_chunks_go_through_the_fetcher_host_pool_when_one_runs(cluster: LocalCluster, tmp_path: Path) -> None:
    rows, view = primary_view(seed=1)
    shm = f"kvt-vllm-{os.getpid()}"
    with LocalFetcher(cluster.config_path, shm, tmp_path / "f.sock", "1MiB", f"{STRIDE}B") as fetcher:
        core = TierCore(
            store_for(cluster.config_path), Keyspace({"model": "fetched"}), view, fetcher=fetcher.socket_path
        )
        double = ManagerDouble(core)
        keys = chunk_keys("fetcher", 3)
        try:
            assert double.wait(double.submit(keys, [0, 1, 2], load=False)).success
            assert double.wait(double.submit(keys, [9, 10, 11], load=True)).success
            assert np.array_equal(rows[9:12], rows[0:3])
            stats = core._fetch_client().stats()
            assert stats["hits"] >= 3  # the load was served from the host pool the store went through
        finally:
            core.shutdown()


def test_the_keyspace_takes_the_deployment_from_vllms_offloading_config() -> None:
    def config(tp: int, model: str = "llama") -> Any:
        return types.SimpleNamespace(
            model=types.SimpleNamespace(name=model, dtype="bfloat16"),
            cache=types.SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
            groups=[types.SimpleNamespace(tokens_per_block=16, layer_names=("l0", "l1"))],
            parallel=types.SimpleNamespace(tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1),
            kv_cache_layout="NHD",
            canonical_layout=False,
            replicated_layout=False,
        )

    digests = {
        Keyspace(identity(c, STRIDE, ns)).digest
        for c, ns in [(config(1), ""), (config(2), ""), (config(1, "mistral"), ""), (config(1), "b")]
    }
    assert len(digests) == 4
    assert Keyspace(identity(config(1), STRIDE, "")).digest == Keyspace(identity(config(1), STRIDE, "")).digest


# --- with vLLM 0.33.0 itself (`make test-vllm` installs it; `make test` does not: its wheel is 336 MB) -----------


def vllm_tiering() -> Any:
    return pytest.importorskip(
        "vllm.v1.kv_offload.tiering.manager",
        reason="vllm 0.33.0 is not installed (make test leaves out its 336 MB wheel: make test-vllm installs it)",
    )


def offloading_config(tp: int = 1) -> Any:
    from vllm.v1.kv_offload import config as c

    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=STRIDE,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="kvtier-test",
        model=c.OffloadingModelConfig(name="llama", dtype="bfloat16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(0, 1, tp, 1, 1, 1, 0, 1, None, True),
    )


def real_manager(settings: dict[str, Any], chunks: int = 8) -> tuple[Any, Any, np.ndarray]:
    """vLLM's TieringOffloadingManager over a real CPU primary tier (a /dev/shm region), with the kvtier tier built
    by vLLM's SecondaryTierFactory from the tier config of docs/adapters.md with ``settings``. A tier the factory
    refuses leaves no region behind."""
    import uuid

    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    tiering = vllm_tiering()
    region = SharedOffloadRegion(uuid.uuid4().hex, chunks, None, STRIDE, STRIDE)
    primary = tiering.CPUPrimaryTierOffloadingManager(chunks, region)
    view = primary.get_kv_memoryview()
    tier_config = {"type": "KvtierTier", "module_path": "kvtier.adapters.vllm", **settings}
    try:
        tier = SecondaryTierFactory.create_secondary_tier(
            tier_config, view, types.SimpleNamespace(config=offloading_config())
        )
    except BaseException:
        primary.shutdown()  # unmaps the region and removes its /dev/shm file
        raise
    manager = tiering.TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0)
    return manager, tier, np.frombuffer(view, dtype=np.int8).reshape(chunks, STRIDE)


def test_vllms_tiering_manager_cascades_chunks_to_kvtier_and_promotes_them_back(cluster: LocalCluster) -> None:
    vllm_tiering()
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

    from kvtier.adapters.vllm import KvtierTier

    manager, tier, rows = real_manager({"config": str(cluster.config_path), "timeout_s": 2.0})
    assert isinstance(tier, KvtierTier)
    step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
    data = np.random.default_rng(7).integers(-128, 128, (4, STRIDE), dtype=np.int8)
    try:
        writer = ReqContext(req_id="writer")
        manager.on_new_request(writer)
        rows[manager.prepare_store(keys, writer).store_spec.chunk_ids] = data  # the GPU's copy into the CPU tier
        manager.complete_store(keys, writer)  # cascades to the kvtier tier
        deadline = time.monotonic() + 30
        while tier.has_pending_work() and time.monotonic() < deadline:
            manager.on_schedule_end(step)
            time.sleep(0.01)
        manager.on_schedule_end(step)
        manager.on_request_finished(writer)
        manager.reset_cache()  # the CPU tier forgets everything: the chunks are in kvtier only
        manager.on_reset_flushed()
        rows[:] = 0
        reader = ReqContext(req_id="reader")
        manager.on_new_request(reader)
        for _ in range(1000):
            answers = [manager.lookup(k, reader) for k in keys]
            if all(a is LookupResult.HIT for a in answers):
                break
            manager.on_schedule_end(step)
            time.sleep(0.01)
        assert answers == [LookupResult.HIT] * 4
        assert np.array_equal(rows[manager.prepare_load(keys, reader).chunk_ids], data)
    finally:
        manager.shutdown()


def shm_regions() -> set[str]:
    return {path.name for path in Path("/dev/shm").glob("vllm_offload_*")}


def test_vllms_factory_refuses_a_tier_config_without_a_cluster_file_and_leaves_no_region(tmp_path: Path) -> None:
    vllm_tiering()
    from kvtier.adapters.store import SettingsError

    before = shm_regions()
    with pytest.raises(SettingsError, match="cluster file"):
        real_manager({"config": str(tmp_path / "missing.toml")})
    assert shm_regions() == before


def test_vllms_factory_refuses_a_tier_config_without_config_or_with_an_unknown_key_in_one_line(
    cluster: LocalCluster,
) -> None:
    vllm_tiering()
    from kvtier.adapters.store import SettingsError

    for settings, what in (({}, "'config' must name"), ({"config": str(cluster.config_path), "ttl": "1d"}, "ttl")):
        with pytest.raises(SettingsError, match=what) as err:
            real_manager(settings)
        assert "\n" not in str(err.value)
