"""The server over a prefill and a decode worker process that meet through the store and the StateBlock directory:
the same greedy answers as one process, the prefill's reuse reported as cached tokens, and a worker that dies is
restarted by its supervisor while its requests fail with an error rather than hang."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest

from kvtier.engine.engine import Engine
from kvtier.serving.text import TextCodec
from tests.conftest import wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def url(start_server, checkpoint: Path, make_cluster) -> str:
    cluster = make_cluster(capacity_bytes=64 << 20).config_path
    return start_server("--checkpoint", str(checkpoint), "--store", str(cluster), "--model", "tiny",
                        "--prefill", "1", "--decode", "1")  # fmt: skip


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_pd_answers_equal_one_process_and_report_the_prefills_reuse(client: openai.OpenAI, checkpoint: Path) -> None:
    ids = [(i * 11 + 5) % 500 + 5 for i in range(700)]
    args = {"model": "tiny", "prompt": ids, "max_tokens": 20, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    alone = Engine.from_pretrained(checkpoint).generate([ids], 20)[0].tokens
    assert first.choices[0].text == again.choices[0].text == TextCodec(checkpoint).decode(alone)
    assert first.usage.completion_tokens == 20
    assert (first.usage.prompt_tokens_details.cached_tokens, again.usage.prompt_tokens_details.cached_tokens) == (
        0,
        512,
    )


def test_pd_streams_and_samples_like_one_process(client: openai.OpenAI, url: str) -> None:
    args = {"model": "tiny", "prompt": "decode streams", "max_tokens": 12, "temperature": 0.8, "seed": 3,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**args).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert streamed == whole


def worker_pids(server_pid: int) -> dict[str, int]:
    """The server's worker processes by role, from /proc."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"kvtier.serving.cli" in cmd:
                found[cmd[cmd.index(b"kvtier.serving.cli") + 1].decode()] = int(d.name)
    return found


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event_and_is_restarted(
    client: openai.OpenAI, url: str
) -> None:
    port = url.rsplit(":", 1)[1]
    server = next(int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _serves(d, port))
    before = worker_pids(server)
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 20000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(events))["choices"][0]["finish_reason"] is None  # the stream has begun
        os.kill(before["decode"], signal.SIGKILL)
        rest = list(events)
    errors = [json.loads(e)["error"] for e in rest if e.startswith('{"error"')]
    assert len(errors) == 1 and "exited" in errors[0]["message"] and rest[-1] == "[DONE]"
    wait_for(lambda: httpx.get(url + "/health").status_code == 200, 180, "the decode worker's restart")
    assert worker_pids(server)["decode"] != before["decode"]
    assert not list(Path("/dev/shm").glob(f"kvtier-state-decode-{before['decode']}-*"))  # its pool was removed
    out = client.completions.create(model="tiny", prompt="after the restart", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def _serves(d: Path, port: str) -> bool:
    try:
        cmd = (d / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in cmd and port.encode() in cmd
