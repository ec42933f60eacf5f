"""``kvtier-engine prefill`` and ``kvtier-engine decode``: prefill/decode workers (P/D disaggregation).

Each worker is its own process with its own model and paged cache; the two meet only through the store
(block KV) and the StateBlock directory (sliding-window state, pulled from the host that holds it):

- **prefill** computes a prompt (reusing any stored prefix), stores its new full blocks, and saves StateBlocks
  at every multiple of 128 plus one at the last block boundary before the final token (the handoff);
- **decode** fetches the whole prompt's blocks and the handoff StateBlock, recomputes at most the last block,
  and generates greedily. Its output equals a single-process run.

Protocol (stdin → stdout, one JSON object a line): the worker first prints
``{"ready": true, "role": ..., "state_host": "HOST:PORT" | null}``, then answers each request
``{"id": ..., "prompt": [token ids], "max_new_tokens": n}`` with one line:
prefill ``{"id", "hit_tokens", "replayed", "ttft_s", "first_token"}``; decode ``{"id", "tokens", "hit_tokens",
"recomputed_tokens", "replayed", "ttft_s"}``. A bad request is answered ``{"id", "error": "one line"}`` and the
worker carries on. End of input ends the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
from typing import Any, TextIO

import torch

from kvtier.engine.checkpoint import DTYPES
from kvtier.engine.engine import Engine, PromptError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="Hugging Face model directory")
    p.add_argument("--store", required=True, help="cluster file")
    p.add_argument("--directory", help="HOST:PORT of the kvtier-directory (StateBlocks across processes)")
    p.add_argument("--fetcher", help="Unix socket of this host's kvtier-fetcher (default: the store client)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--state-pool-bytes", type=int, default=256 << 20, help="StateBlock pool size (default 256 MiB)")


def serve(role: str, args: argparse.Namespace, requests: TextIO = sys.stdin, out: TextIO = sys.stdout) -> None:
    torch.set_num_threads(args.threads)
    with Engine.from_pretrained(
        args.checkpoint,
        args.device,
        DTYPES[args.dtype],
        store=args.store,
        fetcher=args.fetcher,
        directory=args.directory,
        host_id=f"{role}-{os.getpid()}",
        state_pool_bytes=args.state_pool_bytes,
    ) as engine:
        engine.handoff = role == "prefill"
        host = getattr(engine.state_blocks, "addr", None)  # a StateBlockHost serves at this address
        _say(out, {"ready": True, "role": role, "state_host": f"{host[0]}:{host[1]}" if host else None})
        for line in requests:
            if line.strip():
                _say(out, _answer(engine, role, line))


def _answer(engine: Engine, role: str, line: str) -> dict[str, Any]:
    rid = None
    try:
        request = json.loads(line)
        rid = request.get("id")
        prompt, new = request["prompt"], int(request.get("max_new_tokens", 16))
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise PromptError("prompt must be a list of token ids")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return {"id": rid, "error": f"bad request: {e}"}
    try:
        if role == "prefill":
            r = engine.generate([prompt], 1)[0]
            return {
                "id": rid,
                "hit_tokens": r.hit_tokens,
                "replayed": r.replayed,
                "ttft_s": r.ttft_s,
                "first_token": r.tokens[0],
            }
        r = engine.generate([prompt], new, resume=True)[0]
    except PromptError as e:
        return {"id": rid, "error": str(e)}
    return {
        "id": rid,
        "tokens": r.tokens,
        "hit_tokens": r.hit_tokens,
        "recomputed_tokens": len(prompt) - r.hit_tokens,
        "replayed": r.replayed,
        "ttft_s": r.ttft_s,
    }


def _say(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


class WorkerProcess:
    """The driving side: a child that prints one ready line and then answers one JSON line per request
    (a ``kvtier-engine prefill|decode`` worker; ``kvtier-directory`` also fits for its ready line)."""

    def __init__(self, argv: list[str], timeout_s: float = 300.0) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready: Any = None
        self.timeout_s = timeout_s  # for each answer (and the ready line)

    @classmethod
    def engine(cls, role: str, *args: str) -> WorkerProcess:
        return cls([sys.executable, "-m", "kvtier.engine.cli", role, *args])

    def wait_ready(self) -> WorkerProcess:
        """Read the ready line (JSON, or the raw text of a non-JSON one); RuntimeError if the child exited."""
        self.ready = self._read()
        return self

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        """End of input (a worker exits when its stdin closes), then terminate whatever is still running."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], self.timeout_s)[0]:
            raise TimeoutError(f"{self.proc.args[3:5]} did not answer within {self.timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args[3:5]} exited with status {self.proc.wait()}")
        return json.loads(line) if line.startswith("{") else line.strip()
