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
