"""Live trace replay: the trace drives a real cluster and its own GC decides what stays."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.tools.replay import replay
from kvtier.tools.traces import load_trace, multi_turn_trace, write_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "conversations.jsonl"
    write_trace(path, multi_turn_trace(60, seed=3))
    return path


def live(config: Path, trace: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.kvbench", "--config", str(config), "replay", str(trace), "--mode", "live",
         *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_with_room_for_everything_the_live_hit_ratio_is_the_ideal_one(make_cluster, trace: Path) -> None:
    local = make_cluster(capacity_bytes=256 << 20)
    done = live(local.config_path, trace, "--bytes-per-token", "16", "--block-tokens", "64", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    expected = replay(load_trace(trace), block_tokens=64)
    assert result["token_hit_ratio"] == pytest.approx(expected.token_hit_ratio)
    assert result["blocks_written"] == expected.blocks_written
    assert result["bytes_read"] == expected.blocks_read * 64 * 16
    assert result["evictions"] == 0 and result["mode"] == "live"


def test_a_small_cluster_evicts_and_hits_less(make_cluster, trace: Path) -> None:
    local = make_cluster(capacity_bytes=2 << 20, gc="interval_s = 0.1\ngrace_s = 0.1\n")
    done = live(local.config_path, trace, "--bytes-per-token", "1KiB", "--block-tokens", "64", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["evictions"] > 0
    assert result["token_hit_ratio"] < result["ideal_token_hit_ratio"]


def test_simulation_options_are_refused_in_live_mode(make_cluster, trace: Path) -> None:
    local = make_cluster(capacity_bytes=64 << 20)
    done = live(local.config_path, trace, "--bytes-per-token", "16", "--capacity-tokens", "1000")
    assert done.returncode == 2
    assert "cluster's own capacity" in done.stderr and "Traceback" not in done.stderr


def test_sim_with_the_clusters_capacity_predicts_live_within_two_points(make_cluster, tmp_path: Path) -> None:
    """12 nodes of 4 MiB hold 576 blocks of 64 KiB (EC 1.2×, 7 KiB slots, per-primary budgets): 46 % of the
    trace's 1,246 distinct blocks. Sim, given the same cluster file and key salt, forecasts what live measures;
    the obvious capacity (12 × 4 MiB / 64 KiB = 768 blocks) forecasts far more."""
    local = make_cluster(capacity_bytes=4 << 20)
    trace = tmp_path / "conversations.jsonl"
    write_trace(trace, multi_turn_trace(200, seed=3, block_tokens=64))
    sizes = ["--bytes-per-token", "1KiB", "--block-tokens", "64", "--salt", "5a17", "--json"]
    done = live(local.config_path, trace, *sizes)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout)
    sim = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.kvbench", "--config", str(local.config_path), "replay", str(trace),
         *sizes],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    forecast = json.loads(sim.stdout)
    assert measured["capacity_blocks"] == forecast["capacity_blocks"] == 576
    assert measured["evictions"] > 0
    assert abs(forecast["token_hit_ratio"] - measured["token_hit_ratio"]) <= 0.02, (forecast, measured)
    obvious = replay(load_trace(trace), block_tokens=64, capacity_tokens=768 * 64, watermarks=(0.9, 0.8))
    assert obvious.token_hit_ratio - measured["token_hit_ratio"] > 0.1
