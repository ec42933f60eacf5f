"""``kvbench ttft`` and ``kvbench swa-replay`` end to end against a real cluster: what they report, not speed."""

from __future__ import annotations

import json

import pytest

from kvtier.tools.kvbench import main as kvbench


@pytest.fixture(scope="module")
def cluster_file(make_cluster) -> str:
    return str(make_cluster(capacity_bytes=64 << 20).config_path)


def test_ttft_reports_each_hit_ratio_with_its_bound(cluster_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--config", cluster_file, "ttft", "--prompt-tokens", "300", "--hits", "0,50", "--repeats", "1", "--json"]
    assert kvbench(args) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["hit_tokens"] for p in points] == [0, 128]
    assert all(p["bound_s"] > 0 and p["speedup"] > 0 for p in points)


def test_swa_replay_reports_the_error_of_replayed_prefills(
    cluster_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--config", cluster_file, "swa-replay", "--prompts", "2", "--new-tokens", "4", "--json"]
    assert kvbench(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["hit_tokens"] > 0 for r in result["prompts"]] == [True, True]
    assert 0 <= result["token_agreement"] <= 1 and result["max_abs_dlogit_max"] >= 0
