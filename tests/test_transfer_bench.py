"""``kvbench stateblock`` runs end to end (tiny sizes; the figures themselves are not tested; ``kvbench fetch``'s
run is in test_fetcher.py, beside its cluster), and both refuse bad options with one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def kvbench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.kvbench", *argv], capture_output=True, text=True, timeout=300
    )


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
