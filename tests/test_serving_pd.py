"""The server over a prefill and a decode worker process that meet through the store and the StateBlock directory:
the same greedy answers as one process, the prefill's reuse reported as cached tokens, and a worker that dies is
restarted by its supervisor while its requests fail with an error rather than hang."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvtier.engine.engine import Engine
from kvtier.engine.sampling import Sampling
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.serving.text import TextCodec
from tests.conftest import wait_for
from tests.test_serving_api import SETTING_IDS, SETTINGS, ask, engine_text, sampled_case
from tests.test_serving_door import Served

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
    assert httpx.get(url + "/health").status_code == 503  # until the decode worker is back
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


@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
def test_pd_answers_every_sampling_setting_as_one_process(client: openai.OpenAI, checkpoint: Path, settings) -> None:
    reference = (reference_engine(checkpoint), TextCodec(checkpoint))
    ids, concrete = sampled_case(reference, settings)
    assert ask(client, ids, concrete) == engine_text(reference, ids, concrete)


def test_pd_logprobs_equal_one_processes(client: openai.OpenAI, checkpoint: Path) -> None:
    ids = list(range(60, 130))
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    engine = reference_engine(checkpoint)
    generation = engine.start(ids, 4, Sampling(logprobs=2), reuse=False)
    while not generation.finish_reason:
        generation.step()
    expected = [lp for lp, _ in generation.logprobs]
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)


_ENGINES: dict[Path, Engine] = {}


def reference_engine(checkpoint: Path) -> Engine:
    if checkpoint not in _ENGINES:
        _ENGINES[checkpoint] = Engine.from_pretrained(checkpoint)
    return _ENGINES[checkpoint]


TENANT_TOKEN = "teamb-" + "0123456789abcdef" * 3
TENANT_FORMAT = "fp8-e4m3"  # the tenant's server keeps its blocks and StateBlocks in a low-precision KV format


@pytest.fixture(scope="module")
def tenant_server(make_cluster, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """P/D as tenant ``teamb`` from the client file and a token file, as a tenant's host runs it, in a KV format."""
    local = make_cluster(capacity_bytes=64 << 20, extra_toml=f'[tenants.teamb]\ntoken = "{TENANT_TOKEN}"')
    public = cluster_mod.write_public(local.config_path)
    tmp = tmp_path_factory.mktemp("tenant")
    token = tmp / "teamb.token"
    token.write_text(TENANT_TOKEN + "\n")
    token.chmod(0o600)
    server = Served(tmp, "--checkpoint", str(checkpoint), "--store", str(public), "--token-file", str(token),
                    "--model", "tiny", "--prefill", "1", "--decode", "1", "--kv-format", TENANT_FORMAT)  # fmt: skip
    server.cluster = local.config_path  # type: ignore[attr-defined]
    yield server
    server.stop()


def served_twice(server: Served, ids: list[int]) -> None:
    """Ask ``server`` for ``ids`` twice: the second reuses the first's blocks."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0}
    answers = [httpx.post(server.url + "/v1/completions", json=body, timeout=120).json() for _ in range(2)]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 512]


def reused(checkpoint: Path, server: Served, ids: list[int], token: str | None, kv_format: str = TENANT_FORMAT) -> int:
    """Prompt tokens an engine of ``kv_format`` reuses of ``ids`` from ``server``'s store, as the tenant of ``token``
    (None: the cluster token's, tenant default)."""
    cluster = server.cluster  # type: ignore[attr-defined]
    with Engine.from_pretrained(checkpoint, store=cluster, token=token, kv_format=kv_format) as engine:
        return engine.generate([ids], 1)[0].hit_tokens


def test_pd_serves_a_tenant_from_its_client_file_and_token_file(tenant_server: Served, checkpoint: Path) -> None:
    ids = [(i * 17 + 3) % 500 + 5 for i in range(700)]
    served_twice(tenant_server, ids)
    assert reused(checkpoint, tenant_server, ids, token=None) == 0  # the blocks are teamb's, not the admin's
    assert reused(checkpoint, tenant_server, ids, token=TENANT_TOKEN) == 512


def test_pd_workers_keep_blocks_in_the_servers_kv_format(tenant_server: Served, checkpoint: Path) -> None:
    ids = [(i * 13 + 7) % 500 + 5 for i in range(700)]
    served_twice(tenant_server, ids)
    hits = {f: reused(checkpoint, tenant_server, ids, TENANT_TOKEN, f) for f in ("exact", TENANT_FORMAT)}
    assert hits == {"exact": 0, TENANT_FORMAT: 512}  # an engine of another format misses them


def test_a_worker_that_dies_is_said_in_one_line_and_so_are_its_restart_and_readiness(tenant_server: Served) -> None:
    server_pid = tenant_server.proc.pid
    decode = worker_pids(server_pid)["decode"]
    os.kill(decode, signal.SIGKILL)
    wait_for(lambda: tenant_server.err.read_text().count("decode-0 is ready") == 2, 180, "the decode worker's restart")
    log = tenant_server.err.read_text()
    assert log.count("decode-0 exited with status -9") == 1 and log.count("decode-0 is restarting") == 1
    assert log.count("decode-0 is ready") == 2
