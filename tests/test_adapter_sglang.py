"""The SGLang HiCache backend against real sglang 0.5.23 (installed by ``make test``) and real local clusters.

SGLang's own ``StorageBackendFactory`` builds the backend from the extra config exactly as ``attach_storage_backend``
does, and the host pool is then registered with it. The pool is :class:`kvtier.tools.hostpool.HostPool` (SGLang's
own pools cannot be imported without a CUDA torchvision: see that module), its memory a memfd from SGLang's
``alloc_shm`` where ``"allocator": "shm"`` is tested.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "sglang.srt.mem_cache.storage", reason="sglang 0.5.23 is not installed: `make test` installs it (--no-deps)"
)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from kvtier.adapters.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.adapters.store import SettingsError  # noqa: E402
from kvtier.kvstore.cluster.local import LocalCluster  # noqa: E402
from kvtier.tools.hostpool import HostPool  # noqa: E402

PAGE = 16
PAGES = 8


def storage_config(path: Path, tp_rank: int = 0, mla: bool = False, model: str = "llama", **extra: Any):
    """The storage config SGLang's cache controller makes, with the extra config of docs/adapters.md."""
    config = {
        "backend_name": "kvtier",
        "module_path": "kvtier.adapters.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "config": str(path),
        "timeout_s": 2.0,
        **extra,
    }
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config=config,
    )


def backend(config: HiCacheStorageConfig, pool: HostPool) -> Any:
    """Built as the server builds it: the factory, then the host pool registered."""
    built = StorageBackendFactory.create_backend("dynamic", config, pool)
    built.register_mem_pool_host(pool)
    return built


def filled_pool(layout: str = "page_first", allocator: str = "default", seed: int = 0) -> HostPool:
    pool = HostPool(64 * PAGE, PAGE, layers=3, heads=2, head_dim=32, layout=layout, allocator=allocator)
    pool.fill(torch.Generator().manual_seed(seed))
    return pool


def page_keys(prefix: str, n: int = PAGES) -> list[str]:
    return [f"{prefix}-{i:04d}" for i in range(n)]


def slots(first_page: int, n: int = PAGES) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def pages(pool: HostPool, first_page: int, n: int = PAGES) -> list[bytes]:
    return [pool.page_bytes((first_page + i) * PAGE) for i in range(n)]


@pytest.fixture(scope="module")
def cluster(make_cluster) -> LocalCluster:
    return make_cluster(capacity_bytes=64 << 20)


@pytest.fixture
def closing() -> Iterator[list]:
    made: list = []
    yield made
    for b in made:
        b.close()


def test_the_factory_builds_the_kvtier_backend_from_the_extra_config(cluster: LocalCluster, closing: list) -> None:
    built = backend(storage_config(cluster.config_path), filled_pool())
    closing.append(built)
    assert isinstance(built, KvtierHiCacheStorage)
    assert built.pieces == 2  # page_first MHA: a page's K and V


@pytest.mark.parametrize(("layout", "allocator"), [("page_first", "default"), ("layer_first", "shm")])
def test_pages_round_trip_bit_for_bit(cluster: LocalCluster, closing: list, layout: str, allocator: str) -> None:
    pool = filled_pool(layout, allocator)
    built = backend(storage_config(cluster.config_path, allocator=allocator), pool)
    closing.append(built)
    keys = page_keys(f"round-trip-{layout}")
    assert built.batch_set_v1(keys, slots(0)) == [True] * PAGES
    assert built.batch_exists(keys) == PAGES
    assert built.batch_get_v1(keys, slots(32)) == [True] * PAGES
    assert pages(pool, 32) == pages(pool, 0)


def test_batch_exists_counts_the_leading_pages_and_gets_report_each_page(cluster: LocalCluster, closing: list) -> None:
    pool = filled_pool(seed=1)
    built = backend(storage_config(cluster.config_path), pool)
    closing.append(built)
    keys = page_keys("partial")
    stored = [0, 1, 2, 3, 4, 6]
    assert built.batch_set_v1([keys[i] for i in stored], torch.cat([slots(i, 1) for i in stored])) == [True] * 6
    assert built.batch_exists(keys) == 5
    assert built.batch_exists(keys[5:]) == 0
    assert built.batch_get_v1(keys, slots(32)) == [i in stored for i in range(PAGES)]
    assert [pages(pool, 32)[i] for i in stored] == [pages(pool, 0)[i] for i in stored]


def test_pages_of_another_rank_model_or_namespace_are_misses(cluster: LocalCluster, closing: list) -> None:
    pool = filled_pool(seed=2)
    keys = page_keys("tenancy")
    writer = backend(storage_config(cluster.config_path), pool)
    closing.append(writer)
    assert all(writer.batch_set_v1(keys, slots(0)))
    others = [
        storage_config(cluster.config_path, tp_rank=1),
        storage_config(cluster.config_path, model="mistral"),
        storage_config(cluster.config_path, namespace="fine-tune-b"),
    ]
    for config in others:
        reader = backend(config, pool)
        closing.append(reader)
        assert reader.batch_exists(keys) == 0
        assert reader.batch_get_v1(keys, slots(32)) == [False] * PAGES
    other_geometry = backend(storage_config(cluster.config_path), filled_pool("layer_first"))
    closing.append(other_geometry)
    assert other_geometry.batch_exists(keys) == 0


def test_mla_pages_are_shared_by_every_rank_and_written_only_by_the_storage_writer(
    cluster: LocalCluster, closing: list
) -> None:
    pool = filled_pool(seed=3)
    rank0 = backend(storage_config(cluster.config_path, tp_rank=0, mla=True), pool)
    rank1 = backend(storage_config(cluster.config_path, tp_rank=1, mla=True), pool)
    closing += [rank0, rank1]
    written_by_rank1 = page_keys("mla-rank1")
    assert rank1.batch_set_v1(written_by_rank1, slots(0)) == [True] * PAGES  # the writer's job, not this rank's
    assert rank0.batch_exists(written_by_rank1) == 0
    keys = page_keys("mla-rank0")
    assert all(rank0.batch_set_v1(keys, slots(0)))
    assert rank1.batch_exists(keys) == PAGES
    assert all(rank1.batch_get_v1(keys, slots(32)))
    assert pages(pool, 32) == pages(pool, 0)


def test_the_older_calls_round_trip_whole_flat_pages(cluster: LocalCluster, closing: list) -> None:
    """As the cache controller's generic path drives them: data pages out, dummy pages in, then copied back."""
    pool = filled_pool(seed=4)
    built = backend(storage_config(cluster.config_path, interface_v1=0), pool)
    closing.append(built)
    keys = page_keys("generic", 4)
    assert built.batch_set(keys, [pool.get_data_page(i * PAGE) for i in range(4)])
    assert built.batch_exists(keys) == 4 and built.exists(keys[0]) and not built.exists("never-stored")
    got = built.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for i, page in enumerate(got):
        pool.set_from_flat_data_page((32 + i) * PAGE, page)
    assert pages(pool, 32, 4) == pages(pool, 0, 4)
    assert built.set("one", pool.get_data_page(5 * PAGE))
    assert built.get("one", pool.get_dummy_flat_data_page()) is not None
    assert built.get("absent", pool.get_dummy_flat_data_page()) is None


def test_every_page_reads_back_with_two_nodes_killed(make_cluster, closing: list) -> None:
    local = make_cluster(capacity_bytes=64 << 20)
    pool = filled_pool(seed=5)
    built = backend(storage_config(local.config_path), pool)
    closing.append(built)
    keys = page_keys("degraded", 32)
    assert all(built.batch_set_v1(keys, slots(0, 32)))
    local.kill(3)
    local.kill(8)
    assert built.batch_exists(keys) == 32  # pages whose primary died are still found (by their shards)
    assert built.batch_get_v1(keys, slots(32, 32)) == [True] * 32
    assert pages(pool, 32, 32) == pages(pool, 0, 32)


def test_sglangs_failure_injection_costs_pages_never_bytes(
    cluster: LocalCluster, closing: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    pool = filled_pool(seed=6)
    built = StorageBackendFactory.create_backend("dynamic", storage_config(cluster.config_path), pool)
    built.register_mem_pool_host(pool)
    closing.append(built)
    assert type(built).__name__ == "HiCacheStorageFailureInjector"
    expected = pages(pool, 0, 4)
    outcomes = set()
    for round_ in range(12):
        keys = page_keys(f"injected-{round_}", 4)
        stored = built.batch_set_v1(keys, slots(0, 4))
        hits = built.batch_exists(keys)
        pool.kv_buffer.view(torch.uint8)[:, 32 * PAGE : 36 * PAGE].zero_()  # a page reported read must be written
        got = built.batch_get_v1(keys, slots(32, 4))
        outcomes.add((all(stored), hits, all(got)))
        for i, ok in enumerate(got):
            if ok:
                assert pages(pool, 32 + i, 1)[0] == expected[i]
        assert hits in (0, 4)
    assert len(outcomes) > 1  # the injector did fail some calls, and others went through


def test_a_store_that_is_down_is_misses_and_failed_writes(make_cluster, closing: list) -> None:
    local = make_cluster(capacity_bytes=64 << 20)
    pool = filled_pool(seed=7)
    built = backend(storage_config(local.config_path), pool)
    closing.append(built)
    keys = page_keys("down")
    assert all(built.batch_set_v1(keys, slots(0)))
    local.stop()
    started = time.monotonic()
    assert built.batch_exists(keys) == 0
    assert built.batch_get_v1(keys, slots(32)) == [False] * PAGES
    assert built.batch_set_v1(page_keys("down-new"), slots(0)) == [False] * PAGES
    assert time.monotonic() - started < 2.0
    assert built.store.stats["failed_calls"] == 0  # refused connections are misses, not failures


def test_a_hung_store_answers_within_the_timeout(make_cluster, closing: list) -> None:
    local = make_cluster(capacity_bytes=64 << 20)
    pool = filled_pool(seed=8)
    built = backend(storage_config(local.config_path, timeout_s=2.0), pool)
    closing.append(built)
    keys = page_keys("hung")
    assert all(built.batch_set_v1(keys, slots(0)))
    for proc in local.procs.values():
        proc.send_signal(signal.SIGSTOP)
    try:
        for call in (
            lambda: built.batch_exists(keys),
            lambda: built.batch_get_v1(keys, slots(32)),
            lambda: built.batch_set_v1(page_keys("hung-new"), slots(0)),
        ):
            started = time.monotonic()
            result = call()
            assert time.monotonic() - started < 2.0 + 1.0  # the timeout, plus a loaded machine's slack
            assert result in (0, [False] * PAGES)
    finally:
        for proc in local.procs.values():
            proc.send_signal(signal.SIGCONT)


def test_wrong_settings_fail_at_start_with_one_line(cluster: LocalCluster, tmp_path: Path) -> None:
    pool = filled_pool()
    cases = {
        "cluster file": storage_config(tmp_path / "missing.toml"),
        "TTL class": storage_config(cluster.config_path, ttl_class="weekly"),
        "token": storage_config(cluster.config_path, token="not-the-token"),
        "timeout_s": storage_config(cluster.config_path, timeout_s=-1),
    }
    for what, config in cases.items():
        with pytest.raises(SettingsError) as err:
            backend(config, pool)
        assert what in str(err.value) and "\n" not in str(err.value)
