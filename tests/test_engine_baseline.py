"""The correctness gate: the checked-in per-sample baseline, with and without prefix reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvtier.engine import baseline
from kvtier.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return baseline.build(tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads(baseline.DEFAULT_FILE.read_text())


def test_the_engine_matches_the_checked_in_baseline(built: tuple[Path, dict], expected: dict) -> None:
    path, header = built
    with Engine.from_pretrained(path) as engine:
        assert baseline.differences(expected, header, baseline.samples(engine)) == []


def test_the_gate_catches_a_small_numeric_change(built: tuple[Path, dict], expected: dict) -> None:
    path, header = built
    with Engine.from_pretrained(path) as engine, torch.no_grad():
        engine.model.model.norm.weight[0] += 1e-3
        assert baseline.differences(expected, header, baseline.samples(engine))


def test_reuse_on_agrees_with_the_baseline_on_every_sample(
    built: tuple[Path, dict], expected: dict, make_cluster
) -> None:
    path, header = built
    with Engine.from_pretrained(path, store=make_cluster(capacity_bytes=64 << 20).config_path) as engine:
        cold = baseline.samples(engine, reuse=True)  # computes and stores every prompt
        reused: list = []
        warm = baseline.samples(engine, reuse=True, results=reused)  # reuses them, exactly
    long_enough = [n - (128 + 6) >= 128 for n in baseline.PROMPT_LENGTHS]  # room for a hit at 128 (window 128)
    assert [(r.hit_tokens > 0, r.replayed) for r in reused] == [(long, False) for long in long_enough]
    assert baseline.differences(expected, header, cold) == []
    assert baseline.differences(expected, header, warm) == []
