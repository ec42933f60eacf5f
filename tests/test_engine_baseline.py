"""The correctness gate: the checked-in per-sample baseline, with and without prefix reuse."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.engine import baseline
from kvtier.engine.engine import Engine


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the baseline was computed with one thread
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return baseline.build(tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads(baseline.DEFAULT_FILE.read_text())


def test_the_engine_matches_the_checked_in_baseline(built: tuple[Path, dict], expected: dict) -> None:
    path, header = built
    assert baseline.differences(expected, header, baseline.samples(Engine.from_pretrained(path))) == []


def test_the_gate_catches_a_small_numeric_change(built: tuple[Path, dict], expected: dict) -> None:
    path, header = built
    engine = Engine.from_pretrained(path)
    with torch.no_grad():
        engine.model.model.norm.weight[0] += 1e-3
    assert baseline.differences(expected, header, baseline.samples(engine))


def test_reuse_on_agrees_with_the_baseline_on_every_sample(
    built: tuple[Path, dict], expected: dict, make_cluster
) -> None:
    path, header = built
    engine = Engine.from_pretrained(path, store=make_cluster(capacity_bytes=64 << 20).config_path)
    cold = baseline.samples(engine, reuse=True)  # computes and stores every prompt
    hits_before = engine.store.client.stats["hits"]
    warm = baseline.samples(engine, reuse=True)  # reuses them
    assert engine.store.client.stats["hits"] > hits_before
    assert baseline.differences(expected, header, cold) == []
    assert baseline.differences(expected, header, warm) == []
