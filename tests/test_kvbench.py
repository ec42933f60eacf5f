"""kvbench driven as a user drives it (a subprocess per run), plus its byte verification and helpers in-process.

Runs are tiny (4 KiB blocks, 1 s put phase, a few MiB) so that the suite stays short on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.tools.benchutil import (
    REREAD_S,
    PageCacheFill,
    busy_seconds,
    latency_percentiles,
    memory_free_bytes,
    page_cache_filled,
    raw_stream_gbps,
)
from kvtier.tools.kvbench.common import ProgressView, VerifyError
from kvtier.tools.kvbench.phases import Session, Spec, Worker, run_putget

TINY = ["--block-size", "4KiB", "--batch-bytes", "64KiB", "--duration", "1", "--max-bytes", "32MiB"]
PHASE_KEYS = {"bytes", "blocks", "calls", "busy_s", "wall_s", "gbps", "blocks_per_s", "ratio_to_raw", "latency_ms"}


def kvbench_run(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.kvbench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def check_phase(phase: dict, raw_gbps: float) -> None:
    assert set(phase) >= PHASE_KEYS
    assert phase["bytes"] > 0 and phase["blocks"] > 0 and phase["calls"] > 0
    assert phase["gbps"] > 0 and phase["blocks_per_s"] > 0
    assert phase["ratio_to_raw"] == pytest.approx(phase["gbps"] / raw_gbps)
    lat = phase["latency_ms"]
    assert set(lat) == {"p50", "p99", "p999"}
    assert 0 < lat["p50"] <= lat["p99"] <= lat["p999"]


# --- putget on its own temporary cluster ---


def test_putget_prints_throughput_latency_and_raw_ratio() -> None:
    result = kvbench_run("putget", *TINY)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("kvtier put", "kvtier get", "GB/s", "blocks/s", "x raw", "raw GB/s", "p50 ms", "p99 ms", "p999 ms"):
        assert text in out
    assert "temporary 12-node local cluster" in out
    assert "read back and verified" in out
    assert "Traceback" not in result.stderr


def test_putget_json_degraded_reads_everything_back() -> None:
    result = kvbench_run("putget", *TINY, "--degraded", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"command", "settings", "cluster", "kvtier", "verified_blocks"}
    assert report["command"] == "putget"
    settings = report["settings"]
    assert settings["block_size"] == 4096 and settings["blocks_per_call"] == 16
    assert settings["batch_bytes"] == 65536 and settings["concurrency"] == 1 and settings["degraded"] == 2
    assert settings["duration_s"] == 1.0 and settings["max_bytes"] == 32 << 20 and settings["fill"] is True
    cluster = report["cluster"]
    assert cluster["kind"] == "temporary" and cluster["nodes"] == 12 and cluster["path"] is None
    assert len(cluster["killed_nodes"]) == 2 and cluster["codec_backend"]
    kv = report["kvtier"]
    assert set(kv) == {"raw_stream_gbps", "put", "get", "get_degraded"}
    assert kv["raw_stream_gbps"] > 0
    for phase in ("put", "get", "get_degraded"):
        check_phase(kv[phase], kv["raw_stream_gbps"])
    assert kv["put"]["stopped_by"] in ("duration", "max_bytes")
    # every block stored was read back (and checked by kvbench) healthy and again with two nodes killed
    assert kv["get"]["blocks"] == kv["get_degraded"]["blocks"] == kv["put"]["blocks"]
    assert kv["get"]["bytes"] == kv["put"]["bytes"] == kv["put"]["blocks"] * 4096
    assert report["verified_blocks"] == 2 * kv["put"]["blocks"]


def test_putget_at_capacity_evicts_to_take_every_timed_put_and_reads_them_all_back() -> None:
    args = ["--block-size", "64KiB", "--batch-bytes", "1MiB", "--duration", "1", "--max-bytes", "8MiB"]
    result = kvbench_run("putget", *args, "--at-capacity", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["cluster"]["at_capacity"] is True and report["settings"]["fill"] is False
    kv = report["kvtier"]
    for phase in ("put", "get", "get_alloc"):
        check_phase(kv[phase], kv["raw_stream_gbps"])
    assert kv["get"]["blocks"] == kv["get_alloc"]["blocks"] == kv["put"]["blocks"]
    assert report["verified_blocks"] == 2 * kv["put"]["blocks"]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_vs_redis() -> None:
    pytest.importorskip("redis")
    result = kvbench_run("putget", *TINY, "--vs-redis", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    redis = report["redis"]
    assert set(redis) == {"raw_stream_gbps", "version", "put", "get"}
    assert redis["version"][0].isdigit()
    for phase in ("put", "get"):
        check_phase(redis[phase], redis["raw_stream_gbps"])
    assert redis["get"]["blocks"] == redis["put"]["blocks"]
    kv = report["kvtier"]
    assert report["verified_blocks"] == kv["get"]["blocks"] + kv["get_alloc"]["blocks"] + redis["get"]["blocks"]


# --- errors a user can cause: one line on stderr, exit status 2 ---


def assert_usage_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvbench"), lines[0]
    assert "error" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--block-size", "12XB"], "--block-size"),
        (["--block-size", "0"], "--block-size"),
        (["--concurrency", "zero"], "--concurrency"),
        (["--duration", "soon"], "--duration"),
        (["--degraded", "3"], "--degraded"),
        (["--max-bytes", "1KiB"], "--max-bytes"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_options(args: list[str], fragment: str) -> None:
    assert_usage_error(kvbench_run("putget", *args), fragment)


def test_missing_cluster_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "cluster.toml"
    assert_usage_error(kvbench_run("--config", str(missing), "putget", *TINY), str(missing), "does not exist")


def test_degraded_needs_its_own_cluster(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, metrics=False)
    assert_usage_error(kvbench_run("--config", str(path), "putget", *TINY, "--degraded", "2"), "--degraded", "--config")


def test_unreachable_cluster(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, metrics=False)  # written, never started
    assert_usage_error(kvbench_run("putget", "--config", str(path), *TINY), "cannot reach")


def test_vs_redis_without_redis_server(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no redis-server here
    assert_usage_error(kvbench_run("putget", *TINY, "--vs-redis", env=env), "redis-server", "apt-get install")


# --- replay ---


def test_replay_prints_json(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 1536, "output_length": 10, "hash_ids": [1, 2, 3]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = kvbench_run("replay", str(trace), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["requests"] == 2
    assert report["token_hit_ratio"] == pytest.approx(1024 / 2560)
    assert report["block_hit_ratio"] == pytest.approx(2 / 5)


def test_replay_missing_trace(tmp_path: Path) -> None:
    result = kvbench_run("replay", str(tmp_path / "none.jsonl"), "--json")
    assert result.returncode == 2
    assert "not found" in result.stderr and "Traceback" not in result.stderr


# --- kvbench's own byte check, with stores that misbehave (in-process) ---


class DictSession(Session):
    """A store in a dict; ``fault`` makes it lose or corrupt a block on read."""

    def __init__(self, fault: str | None = None) -> None:
        self.data: dict[bytes, bytes] = {}
        self.fault = fault

    def put(self, keys: list[bytes]) -> None:
        size = self.spec.block_size
        for i, key in enumerate(keys):
            self.data[key] = bytes(self.src[i * size : (i + 1) * size])

    def get(self, keys: list[bytes]) -> list[bool]:
        size = self.spec.block_size
        found = []
        for i, key in enumerate(keys):
            value = self.data.get(key)
            if value is not None and self.fault == "lose" and i == 1:
                value = None
            if value is not None:
                self.dst[i * size : (i + 1) * size] = value
                if self.fault == "corrupt" and i == 2:
                    self.dst[i * size + size // 2] ^= 0xFF
                if self.fault == "skip" and i == 3:  # claims a hit but writes nothing
                    self.dst[i * size : (i + 1) * size] = bytes(size)
            found.append(value is not None)
        return found

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            self.data.pop(key, None)


SPEC = Spec(block_size=4096, blocks_per_call=8, concurrency=2, duration_s=0.05, max_bytes=4 << 20)


def test_verification_accepts_a_correct_store() -> None:
    result, workers = run_putget("dict", [DictSession(), DictSession()], SPEC, ProgressView())
    assert result["get"]["blocks"] == result["put"]["blocks"] > 0
    stored = {key for w in workers for batch in w.batches for key in batch}
    assert len(stored) == result["put"]["blocks"]  # fresh keys every batch


@pytest.mark.parametrize(("fault", "message"), [("lose", "not found"), ("corrupt", "wrong bytes"), ("skip", "wrong")])
def test_verification_catches_a_bad_store(fault: str, message: str) -> None:
    with pytest.raises(VerifyError, match=message):
        run_putget("dict", [DictSession(fault), DictSession(fault)], SPEC, ProgressView())


def test_every_shard_of_a_block_carries_its_key() -> None:
    worker = Worker(0, DictSession(), Spec(1 << 20, 2, 1, 1.0, 8 << 20))
    keys = [b"A" * 16, b"B" * 16]
    worker.stamp(keys)
    shard = -(-(1 << 20) // 10)
    for b, key in enumerate(keys):
        block = bytes(worker.src[b << 20 : (b + 1) << 20])
        for i in range(10):
            assert key in block[i * shard : (i + 1) * shard]


# --- benchutil ---


def test_busy_seconds_is_the_union_of_intervals() -> None:
    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert busy_seconds([(3, 4), (0, 10)]) == pytest.approx(10.0)


def test_latency_percentiles_nearest_rank() -> None:
    p = latency_percentiles([i / 1000 for i in range(1, 1001)])  # 1 ms … 1000 ms
    assert p == pytest.approx({"p50": 500.0, "p99": 990.0, "p999": 999.0})
    assert latency_percentiles([0.002])["p999"] == pytest.approx(2.0)


def test_raw_stream_moves_the_bytes() -> None:
    assert raw_stream_gbps(8 << 20) > 0


def test_a_page_cache_fill_leaves_no_file_behind(tmp_path: Path) -> None:
    with page_cache_filled(str(tmp_path), leave_free=max(0, memory_free_bytes() - (16 << 20))) as fill:
        assert list(tmp_path.iterdir()) == []
        assert fill.refresh() == fill.bytes
    assert list(tmp_path.iterdir()) == []


def test_a_page_cache_fill_reads_itself_whole_again_only_after_the_reread_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    fd = os.open(tmp_path / "fill", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fill = PageCacheFill(fd, leave_free=max(0, memory_free_bytes() - (32 << 20)), clock=lambda: now[0])
        fill.refresh()
        fill.leave_free = memory_free_bytes() + (1 << 40)  # no more growth: only re-reads would read
        read_from: list[int] = []
        real_preadv = os.preadv
        monkeypatch.setattr(
            os, "preadv", lambda fd, bufs, offset: read_from.append(offset) or real_preadv(fd, bufs, offset)
        )
        now[0] += REREAD_S / 2
        fill.refresh()
        assert read_from == []
        now[0] += REREAD_S
        fill.refresh()
        assert read_from and read_from[0] == 0 and fill.bytes > 0
    finally:
        os.close(fd)


def test_a_page_cache_fill_takes_nothing_when_memory_is_short(tmp_path: Path) -> None:
    with page_cache_filled(str(tmp_path), leave_free=memory_free_bytes() + (1 << 40)) as fill:
        assert fill.bytes == 0


# --- adapter: pages through the engine adapters, against the raw client ---


def test_adapter_reports_each_engine_against_the_raw_client() -> None:
    result = kvbench_run("adapter", "--pages", "2", "--page-size", "64KiB", "--rounds", "1", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["engines"]) == {"sglang", "vllm", "lmcache"}
    for name, engine in report["engines"].items():
        if "skipped" in engine:  # sglang and lmcache need their packages (make test installs them)
            assert name != "vllm" and "pip install" in engine["skipped"]
            continue
        assert engine["bytes_per_call"] >= 2 * (64 << 10)
        for path in ("put", "get"):
            assert engine[f"{path}_gbps"] > 0 and engine[f"raw_{path}_gbps"] > 0 and engine[f"{path}_ratio"] > 0


def test_adapter_refuses_an_unknown_engine() -> None:
    result = kvbench_run("adapter", "--engines", "tgi")
    assert result.returncode == 2 and "unknown engines tgi" in result.stderr
