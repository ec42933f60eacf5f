"""Prefill and decode as separate worker processes that meet only through the store and the StateBlock directory;
StateBlocks shared between engines through the directory."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.engine.engine import Engine
from kvtier.engine.worker import WorkerProcess

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cluster(make_cluster) -> Path:
    return make_cluster(capacity_bytes=64 << 20).config_path


@pytest.fixture(scope="module")
def address(cluster: Path) -> Iterator[str]:
    """HOST:PORT of a ``kvtier-directory`` process."""
    argv = [sys.executable, "-m", "kvtier.transfer.directory", "--config", str(cluster), "--listen", "127.0.0.1:0"]
    directory = WorkerProcess(argv).wait_ready()
    yield directory.ready.split()[1]
    directory.proc.terminate()
    directory.stop()


@pytest.fixture(scope="module")
def setup(checkpoint: Path, cluster: Path, address: str) -> Iterator[tuple[Path, WorkerProcess, WorkerProcess]]:
    common = ["--checkpoint", str(checkpoint), "--store", str(cluster), "--directory", address]
    prefill = WorkerProcess.engine("prefill", *common)
    decode = WorkerProcess.engine("decode", *common)
    prefill.wait_ready()  # both started before either is awaited: their imports overlap
    decode.wait_ready()
    yield checkpoint, prefill, decode
    for w in (prefill, decode):
        w.stop()


def test_decode_reads_what_prefill_stored_and_matches_one_process(
    setup: tuple[Path, WorkerProcess, WorkerProcess],
) -> None:
    checkpoint, prefill, decode = setup
    assert prefill.ready["state_host"] and decode.ready["state_host"]  # each its own StateBlock host
    prompt = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(11)).tolist()
    stored = prefill.ask({"id": "a", "prompt": prompt})
    out = decode.ask({"id": "a", "prompt": prompt, "max_new_tokens": 24})
    alone = Engine.from_pretrained(checkpoint).generate([prompt], 24)[0]
    assert stored["hit_tokens"] == 0
    assert (out["hit_tokens"], out["recomputed_tokens"], out["replayed"]) == (960, 40, False)
    assert out["tokens"] == alone.tokens
    assert out["tokens"][0] == stored["first_token"]


def test_a_bad_request_is_one_error_line_and_the_worker_carries_on(
    setup: tuple[Path, WorkerProcess, WorkerProcess],
) -> None:
    _, _, decode = setup
    assert decode.ask({"id": "x", "prompt": "not tokens"})["error"].startswith("bad request")
    assert "longer than the model's context" in decode.ask({"id": "y", "prompt": [1] * 40000})["error"]
    assert len(decode.ask({"id": "z", "prompt": [1, 2, 3], "max_new_tokens": 2})["tokens"]) == 2


def test_an_engine_reuses_another_process_state_exactly_through_the_directory(
    checkpoint: Path, cluster: Path, address: str
) -> None:
    """Without the directory this is a bounded replay (see test_engine_reuse); with it, exact reuse."""
    p = torch.randint(0, 512, (2000,), generator=torch.Generator().manual_seed(14)).tolist()
    longer = p + torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(15)).tolist()
    with Engine.from_pretrained(checkpoint, store=cluster, directory=address, host_id="a") as a:
        a.generate([p], 1)
        with Engine.from_pretrained(checkpoint, store=cluster, directory=address, host_id="b") as b:
            result = b.generate([longer], 16)[0]
            plain = b.generate([longer], 16, reuse=False)[0]
    assert (result.hit_tokens, result.replayed) == (1920, False)
    assert result.tokens == plain.tokens
    assert (result.first_logits - plain.first_logits).abs().max().item() <= 1e-4
