"""``kvbench fetch`` and ``kvbench stateblock`` run end to end (tiny sizes; the figures themselves are not tested),
and refuse bad options with one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.kvstore.local import LocalCluster
from tests.conftest import ClusterFactory


def kvbench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.kvbench", *argv], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def cluster(make_cluster: ClusterFactory) -> LocalCluster:
    return make_cluster(capacity_bytes=32 << 20)


def test_kvbench_fetch_reports_the_ratio_to_get_into(cluster: LocalCluster) -> None:
    done = kvbench("--config", str(cluster.config_path), "fetch", "--block-size", "64KiB", "--blocks", "4",
                   "--rounds", "1", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["fetch_vs_get_into"] > 0 and result["pool"]["hits"] == 16 and result["pool"]["evictions"] == 12


def test_kvbench_stateblock_reports_the_ratio_to_a_raw_round_trip() -> None:
    done = kvbench("stateblock", "--layers", "2", "--iterations", "3", "--rounds", "1", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["settings"]["stateblock_bytes"] == 2 * 134 * 528 and result["pull_vs_raw_p50"] > 0


@pytest.mark.parametrize(
    "argv",
    [["fetch", "--blocks", "0"], ["fetch", "--block-size", "lots"], ["stateblock", "--layers", "0"]],
)
def test_bad_options_are_one_line(argv: list[str]) -> None:
    done = kvbench(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("kvbench: error:")
