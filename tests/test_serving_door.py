"""The server's front door, as a vLLM user meets it: an API key on every route but ``/health`` and ``/metrics``,
bodies capped, vLLM's flags (served names with aliases, ``--max-model-len``, ``--chat-template``), ``/version``,
``X-Request-Id``, limits a request could never meet refused up front, one access log line per request, the port
bound before ``serving at``, and a SIGTERM that ends running streams with an error event and ``[DONE]``."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.engine import worker
from kvtier.serving import cli
from kvtier.tools.benchutil import free_port
from tests.conftest import wait_for

KEY = "sk-door-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Served:
    """``kvtier-engine serve`` as a process, its stdout and stderr in files."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err = tmp / f"serve-{self.port}.out", tmp / f"serve-{self.port}.err"
        argv = [sys.executable, "-m", "kvtier.serving.cli", "serve", "--port", str(self.port), *args]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env={**os.environ, **(env or {})})
        if wait:
            wait_for(self.healthy, 180, "the server's /health to answer 200", poll_s=0.2)

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the server exited with status {self.proc.returncode}:\n{self.err.read_text()[-2000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def store(make_cluster) -> Path:
    return make_cluster(capacity_bytes=64 << 20).config_path


@pytest.fixture(scope="module")
def served(store: Path, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("door")
    template = tmp / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    server = Served(
        tmp, "--checkpoint", str(checkpoint), "--store", str(store), "--served-model-name", "tiny", "tiny-alias",
        "--max-model-len", "2048", "--max-request-bytes", "200000", "--cache-tokens", "1024",
        "--chat-template", str(template), env={cli.API_KEY_ENV: KEY},
    )  # fmt: skip
    yield server
    server.stop()


def test_every_route_but_health_and_metrics_needs_the_api_key(served: Served) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(served.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    for path in ("/v1/models", "/version"):
        assert httpx.get(served.url + path).status_code == 401
    assert httpx.post(served.url + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    assert httpx.get(served.url + "/health").status_code == 200 and httpx.get(served.url + "/metrics").is_success


def test_a_body_past_max_request_bytes_is_a_413_in_openais_error_shape(served: Served) -> None:
    body = b'{"model": "tiny", "prompt": "' + b"a" * 300_000 + b'"}'
    r = httpx.post(served.url + "/v1/completions", content=body, headers=AUTH, timeout=60)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    assert httpx.get(served.url + "/health").status_code == 200


def test_served_model_names_are_aliases_and_the_first_is_reported(served: Served) -> None:
    cards = httpx.get(served.url + "/v1/models", headers=AUTH).json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "tiny-alias"] and cards[0]["max_model_len"] == 2048
    body = {"model": "tiny-alias", "prompt": "hi", "max_tokens": 1}
    assert httpx.post(served.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["model"] == "tiny"


def test_max_model_len_bounds_the_context(served: Served) -> None:
    body = {"model": "tiny", "prompt": list(range(5, 505)) * 5, "max_tokens": 1}
    r = httpx.post(served.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]


def test_the_chat_template_flag_replaces_the_checkpoints(served: Served, checkpoint: Path) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
    got = httpx.post(served.url + "/tokenize", json=body, headers=AUTH).json()["tokens"]
    from kvtier.serving.text import TextCodec

    assert got == TextCodec(checkpoint).encode("[user] hello\n[assistant] ")


def test_version_and_the_request_id_are_answered(served: Served) -> None:
    assert httpx.get(served.url + "/version", headers=AUTH).json()["version"]
    r = httpx.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                   headers={**AUTH, "X-Request-Id": "abc-123"}, timeout=60)  # fmt: skip
    assert r.headers["X-Request-Id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"


def test_more_kv_than_a_workers_cache_holds_is_a_400_naming_the_cache(served: Served) -> None:
    body = {"model": "tiny", "prompt": list(range(5, 505)), "max_tokens": 600}  # 1,100 tokens: within 2,048
    r = httpx.post(served.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 400 and "--cache-tokens" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"


def test_each_request_is_one_access_log_line(served: Served) -> None:
    httpx.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": "log me", "max_tokens": 2},
               headers=AUTH, timeout=60)  # fmt: skip
    wait_for(lambda: '"POST /v1/completions" 200 tokens=2' in served.err.read_text(), 10, "the access log line")


def test_a_worker_process_gets_every_option_the_embedded_engine_gets() -> None:
    serve_args = ["serve", "--checkpoint", "ck", "--store", "c.public.toml", "--token-file", "t.token",
                  "--state-pool-bytes", "12345", "--cache-tokens", "8192", "--chunk-tokens", "256", "--threads", "2",
                  "--dtype", "bfloat16", "--device", "cpu", "--fetcher", "/f.sock", "--store-timeout-ms", "150",
                  "--max-num-seqs", "3", "--cost-model", "c.json", "--step-budget-ms", "50",
                  "--kv-format", "main=fp8-e4m3,window=mxfp8"]  # fmt: skip
    args = cli.build_parser().parse_args(serve_args)
    argv = cli.worker_argv("prefill", args, "127.0.0.1:7400")
    assert argv[1:4] == ["-m", "kvtier.serving.cli", "prefill"]
    got = cli.build_parser().parse_args(argv[3:])
    probe = argparse.ArgumentParser()
    worker.add_arguments(probe)
    cli.add_budget_arguments(probe)
    for action in probe._actions[1:]:
        expected = "127.0.0.1:7400" if action.dest == "directory" else getattr(args, action.dest)
        assert getattr(got, action.dest) == expected, action.dest


def test_serving_at_is_said_only_once_the_port_is_bound(checkpoint: Path, store: Path, tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvtier.serving.cli", "serve", "--checkpoint", str(checkpoint), "--store",
             str(store), "--port", str(port)], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2 and "serving at" not in done.stdout
    assert done.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_sigterm_ends_a_running_stream_with_an_error_event_and_done_and_no_traceback(
    checkpoint: Path, store: Path, tmp_path: Path
) -> None:
    server = Served(tmp_path, "--checkpoint", str(checkpoint), "--store", str(store), "--shutdown-grace-s", "1",
                    "--api-key", KEY, "--disable-access-log")  # fmt: skip
    body = {"model": "tiny", "prompt": "go on", "max_tokens": 20000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
        next(lines)
        server.proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        rest = list(lines)
    assert time.monotonic() - began < 30
    assert rest[-1] == "[DONE]" and '"error"' in rest[-2] and "shutting down" in rest[-2]
    assert server.proc.wait(timeout=120) == 0
    assert "Traceback" not in server.err.read_text()
    assert '"POST /v1/completions"' not in server.err.read_text()  # (--disable-access-log)


def test_a_missing_cost_model_is_one_line_naming_the_option(checkpoint: Path, store: Path) -> None:
    args = cli.build_parser().parse_args(["serve", "--checkpoint", str(checkpoint), "--store", str(store),
                                          "--cost-model", "cost.json"])  # fmt: skip
    with pytest.raises(ValueError, match=r"--cost-model cost\.json: No such file"):
        cli.make_server(args)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--kv-format", "fp7"], "KV format 'fp7': use one of exact, bf16"),
        (["--kv-format", "fp8-e4m3", "--dtype", "float16"], "decode to bfloat16 or float32, not torch.float16"),
    ],
    ids=["unknown", "not-for-this-model"],
)
def test_a_kv_format_serve_cannot_use_is_one_line_before_any_worker_starts(
    checkpoint: Path, store: Path, options: list[str], says: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.serving.cli", "serve", "--checkpoint", str(checkpoint), "--store", str(store),
         "--port", str(free_port()), "--prefill", "1", "--decode", "1", *options],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "serving at" not in done.stdout
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr[-2000:]
    assert "prefill-0" not in done.stderr and "decode-0" not in done.stderr
