"""Prefill and decode as separate worker processes that meet only through the store and the StateBlock directory."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine.checkpoint import make_checkpoint
from kvtier.engine.engine import Engine


class Worker:
    """A child process speaking JSON lines: ``ask(request) -> answer``."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready: Any = None

    def wait_ready(self) -> Worker:
        self.ready = self.read()
        return self

    def read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"worker exited with status {self.proc.wait()}"
        return json.loads(line) if line.startswith("{") else line.strip()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def setup(make_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Worker, Worker]]:
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", "tiny", seed=0)
    cluster = make_cluster(capacity_bytes=64 << 20).config_path
    argv = [sys.executable, "-m", "kvtier.transfer.directory", "--config", str(cluster), "--listen", "127.0.0.1:0"]
    directory = Worker(argv).wait_ready()
    address = directory.ready.split()[1]
    common = ["--checkpoint", str(checkpoint), "--store", str(cluster), "--directory", address]
    prefill = Worker([sys.executable, "-m", "kvtier.engine.cli", "prefill", *common])
    decode = Worker([sys.executable, "-m", "kvtier.engine.cli", "decode", *common])
    prefill.wait_ready()  # both started before either is awaited: their imports overlap
    decode.wait_ready()
    yield checkpoint, prefill, decode
    for w in (prefill, decode):
        w.stop()
    directory.proc.terminate()
    directory.proc.wait()


def test_decode_reads_what_prefill_stored_and_matches_one_process(setup: tuple[Path, Worker, Worker]) -> None:
    checkpoint, prefill, decode = setup
    assert prefill.ready["state_host"] and decode.ready["state_host"]  # each its own StateBlock host
    prompt = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(11)).tolist()
    stored = prefill.ask({"id": "a", "prompt": prompt})
    out = decode.ask({"id": "a", "prompt": prompt, "max_new_tokens": 24})
    torch.set_num_threads(1)
    alone = Engine.from_pretrained(checkpoint).generate([prompt], 24)[0]
    assert stored["hit_tokens"] == 0
    assert (out["hit_tokens"], out["recomputed_tokens"], out["replayed"]) == (960, 40, False)
    assert out["tokens"] == alone.tokens
    assert out["tokens"][0] == stored["first_token"]


def test_a_bad_request_is_one_error_line_and_the_worker_carries_on(setup: tuple[Path, Worker, Worker]) -> None:
    _, _, decode = setup
    assert decode.ask({"id": "x", "prompt": "not tokens"})["error"].startswith("bad request")
    assert "longer than the model's context" in decode.ask({"id": "y", "prompt": [1] * 40000})["error"]
    assert len(decode.ask({"id": "z", "prompt": [1, 2, 3], "max_new_tokens": 2})["tokens"]) == 2
