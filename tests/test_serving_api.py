"""The OpenAI-compatible server with its engine embedded, driven by the ``openai`` client and raw HTTP: text and
chat completions equal the engine's own greedy output, streams carry usage, a repeated prompt reports the tokens
it reused, a burst past the queue limit gets 429s, every kind of bad input gets a 400 and costs nothing, and a
client that goes away aborts its request."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from kvtier.engine.engine import Engine
from kvtier.engine.sampling import Sampling
from kvtier.serving.text import TextCodec
from tests.conftest import wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_QUEUED = 3


@pytest.fixture(scope="module")
def url(start_server, checkpoint: Path, make_cluster) -> str:
    cluster = make_cluster(capacity_bytes=64 << 20).config_path
    store = ["--checkpoint", str(checkpoint), "--store", str(cluster), "--model", "tiny"]
    return start_server(*store, "--max-queued-requests", str(MAX_QUEUED))


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> tuple[Engine, TextCodec]:
    return Engine.from_pretrained(checkpoint), TextCodec(checkpoint)


def greedy_text(reference: tuple[Engine, TextCodec], ids: list[int], n: int) -> tuple[str, str]:
    """What the server must answer for ``ids`` and ``max_tokens=n`` at temperature 0: the engine's greedy tokens
    up to the first EOS, as text, and the finish reason."""
    engine, codec = reference
    tokens = engine.generate([ids], n)[0].tokens
    for i, t in enumerate(tokens):
        if t in codec.eos_token_ids:
            return codec.decode(tokens[: i + 1]), "stop"
    return codec.decode(tokens), "length"


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_text_completion_is_the_engines_greedy_output(client: openai.OpenAI, reference) -> None:
    prompt = "The store keeps prefix blocks erasure coded across twelve nodes."
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    ids = reference[1].encode(prompt)
    assert (out.choices[0].text, out.choices[0].finish_reason) == greedy_text(reference, ids, 12)
    assert out.usage.prompt_tokens == len(ids)


def test_a_prompt_of_token_ids_is_accepted(client: openai.OpenAI, reference) -> None:
    ids = list(range(10, 60))
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert (out.choices[0].text, out.choices[0].finish_reason) == greedy_text(reference, ids, 6)


def test_a_chat_is_rendered_with_the_checkpoints_template(client: openai.OpenAI, reference) -> None:
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is kvtier?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    codec = reference[1]
    ids = codec.encode(codec.render_chat(messages))
    tail = codec.encode("<|im_start|>assistant\n")
    assert ids[-len(tail) :] == tail and tail[0] == 3  # the marker is one special token
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == greedy_text(reference, ids, 10)
    assert out.choices[0].message.role == "assistant"


def test_a_stream_carries_the_same_text_and_ends_with_usage(client: openai.OpenAI) -> None:
    args = {"model": "tiny", "messages": [{"role": "user", "content": "stream this"}], "max_tokens": 9}
    whole = client.chat.completions.create(**args, temperature=0)
    chunks = list(client.chat.completions.create(**args, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_completion_stream_ends_with_a_usage_chunk_before_done(url: str) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_sampling_with_a_seed_repeats_and_temperature_zero_is_greedy(client: openai.OpenAI, reference) -> None:
    ids = list(range(100, 140))
    args = {"model": "tiny", "prompt": ids, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    a, b, c = (client.completions.create(**args, temperature=1.0, seed=s).choices[0].text for s in (7, 7, 8))
    assert a == b != c
    greedy = client.completions.create(**args, temperature=0, seed=7).choices[0].text
    assert greedy == reference[1].decode(reference[0].generate([ids], 8)[0].tokens)


def test_a_stop_string_ends_the_answer_before_it(client: openai.OpenAI) -> None:
    ids = list(range(200, 260))
    full = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0).choices[0].text
    stop = full[5:8]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_a_repeated_prompt_reports_its_reused_tokens(client: openai.OpenAI) -> None:
    ids = [(i * 7 + 3) % 500 + 5 for i in range(420)]  # L = 420: the hit rule reuses 256 (a multiple of 128)
    first = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 256
    assert again.choices[0].text == first.choices[0].text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "tiny", "prompt": "unterminated', None),
        (json.dumps({"model": "tiny", "prompt": [1] * 32768}).encode(), "prompt"),
        (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
        (b'{"model": "tiny", "prompt": [1, 2, 512]}', "prompt"),
        (b'{"model": "tiny", "prompt": [1, 2, -1]}', "prompt"),
        (b'{"model": "tiny", "prompt": "hi", "temperature": -1}', "temperature"),
        (b'{"model": "tiny", "prompt": "hi", "max_tokens": "many"}', "max_tokens"),
        (b'{"model": "tiny", "prompt": "hi", "n": 0}', "n"),
        (b'{"model": "tiny", "prompt": "hi", "top_k": -5}', "top_k"),
        (b'{"model": "tiny", "prompt": "hi", "min_p": 2}', "min_p"),
        (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"999": 1}}', "logit_bias"),
        (b'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "min_tokens": 5}', "min_tokens"),
        (b'{"model": "tiny", "prompt": "hi", "repetition_penalty": 0}', "repetition_penalty"),
        (b'{"model": "tiny", "prompt": "hi", "logprobs": 21}', "logprobs"),
        (b'{"model": "tiny", "prompt": "hi", "stop_token_ids": [600]}', "stop_token_ids"),
        (b'{"model": "tiny", "prompt": "hi", "best_of": 2}', "best_of"),
        (b'{"model": "tiny", "prompt": "hi", "suffix": "x"}', "suffix"),
        (b'{"model": "tiny", "prompt": "hi", "echo": true}', "echo"),
        (b'{"model": "tiny", "prompt": "hi", "response_format": {"type": "json_object"}}', "response_format"),
        (b'{"model": "tiny", "prompt": "hi", "tools": [{"type": "function"}]}', "tools"),
        (b'{"model": "tiny", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}", "prompt"),
        (b'{"model": "tiny", "prompt": "hi", "extra": ' + b"[" * 2000 + b"]" * 2000 + b"}", None),
        (json.dumps({"model": "tiny", "prompt": "x" * 400_000}).encode(), "prompt"),
    ],
    ids=["malformed-json", "longer-than-context", "max-tokens-0", "id-past-vocab", "negative-id",
         "negative-temperature", "max-tokens-not-int", "n-0", "top-k", "min-p", "logit-bias-past-vocab",
         "min-tokens-past-max", "repetition-0", "logprobs-21", "stop-id-past-vocab", "best-of", "suffix", "echo",
         "response-format", "tools", "deep-prompt", "deep-unknown-field", "text-past-any-context"],
)  # fmt: skip
def test_bad_input_is_a_400_in_openais_error_shape(url: str, body: bytes, param: str | None) -> None:
    r = httpx.post(url + "/v1/completions", content=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 1},
                      timeout=60).status_code == 200  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x" * 400_000}]}, "messages"),
    ],
    ids=["top-logprobs-without-logprobs", "max-completion-tokens-0", "tool-choice", "text-past-any-context"],
)
def test_bad_chat_input_is_a_400_naming_the_field(url: str, body: dict, param: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_deep_json_to_tokenize_is_a_400(url: str) -> None:
    r = httpx.post(url + "/tokenize", content=b'{"prompt": "a", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404_naming_the_model(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-5", "prompt": "hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_unknown_routes_and_methods_answer_in_openais_error_shape(url: str) -> None:
    for r, status in ((httpx.get(url + "/v1/nothing"), 404), (httpx.get(url + "/v1/completions"), 405)):
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_null_n_and_null_stream_are_the_defaults(url: str) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 2, "n": None, "stream": None, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_a_request_that_could_never_be_admitted_is_a_400_naming_the_limit(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "n": MAX_QUEUED + 1}, timeout=60)
    assert r.status_code == 400 and "--max-queued-requests" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "n"


SETTINGS = [
    {"temperature": 0, "logit_bias": {"30": 100}},
    {"temperature": 1.0, "top_k": 1, "seed": 4},
    {"temperature": 0.9, "top_k": 5, "min_p": 0.05, "seed": 4},
    {"temperature": 0, "presence_penalty": 2.0, "frequency_penalty": 2.0},
    {"temperature": 0, "repetition_penalty": 1.8},
    {"temperature": 0, "min_tokens": 6, "stop_token_ids": "first"},  # the first token it would have made
]
SETTING_IDS = ["logit-bias", "top-k-1", "top-k-min-p", "penalties", "repetition", "min-tokens"]


def as_sampling(settings: dict[str, Any]) -> Sampling:
    fields = {k: v for k, v in settings.items() if k not in ("logit_bias", "stop_token_ids")}
    bias = tuple((int(k), float(v)) for k, v in settings.get("logit_bias", {}).items())
    return Sampling(**fields, logit_bias=bias, stop_token_ids=frozenset(settings.get("stop_token_ids", ())))


def engine_text(reference: tuple[Engine, TextCodec], ids: list[int], settings: dict[str, Any]) -> str:
    """The engine's answer of 8 tokens with ``settings`` (to its first stop token), as text."""
    engine, codec = reference
    tokens = engine.generate([ids], 8, reuse=False, sampling=as_sampling(settings))[0].tokens
    stop = settings.get("stop_token_ids", [])
    return codec.decode(tokens[: next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))])


def sampled_case(reference: tuple[Engine, TextCodec], settings: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """A prompt on which ``settings`` change the engine's answer from what temperature and seed alone give (so a
    server that ignored them would fail), with ``"first"`` stop ids made concrete."""
    base = {k: v for k, v in settings.items() if k in ("temperature", "seed")}
    for shift in range(40):
        ids = [(i * 13 + 7 + shift * 11) % 500 + 5 for i in range(80)]
        concrete = dict(settings)
        if concrete.get("stop_token_ids") == "first":
            concrete["stop_token_ids"] = [reference[0].generate([ids], 1, reuse=False)[0].tokens[0]]
        if engine_text(reference, ids, concrete) != engine_text(reference, ids, base):
            return ids, concrete
    raise AssertionError(f"no prompt on which {settings} change the answer")


def ask(client: openai.OpenAI, ids: list[int], settings: dict[str, Any]) -> str:
    extra = {k: v for k, v in settings.items() if k not in ("temperature", "seed")}
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=settings["temperature"],
                                    seed=settings.get("seed"), extra_body={"ignore_eos": True, **extra})  # fmt: skip
    return out.choices[0].text


@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
def test_each_sampling_setting_answers_as_the_engine_with_it(client: openai.OpenAI, reference, settings: dict) -> None:
    ids, concrete = sampled_case(reference, settings)
    assert ask(client, ids, concrete) == engine_text(reference, ids, concrete)


def test_logprobs_of_a_completion_come_as_vllm_gives_them(url: str, reference) -> None:
    ids = list(range(60, 90))
    body = {"model": "tiny", "prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    lp = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    engine, codec = reference
    first = engine.generate([ids], 1, reuse=False)[0]
    expected = torch.log_softmax(first.first_logits, -1)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 3
    assert lp["tokens"][0] == codec.token_text(first.tokens[0])
    assert lp["token_logprobs"][0] == pytest.approx(float(expected[first.tokens[0]]), abs=1e-3)
    assert 2 <= len(lp["top_logprobs"][0]) <= 3 and lp["text_offset"][0] == 0
    streamed = [json.loads(e) for e in sse_events(url + "/v1/completions", {**body, "stream": True})[:-1]]
    assert [t for c in streamed for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])] == lp["tokens"]


def test_logprobs_of_a_chat_come_as_openai_gives_them(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_n_choices_each_sample_with_their_own_seed(client: openai.OpenAI) -> None:
    args = {"model": "tiny", "prompt": list(range(20, 50)), "max_tokens": 6, "temperature": 1.0, "seed": 9,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    many = client.completions.create(**args, n=3)
    one = client.completions.create(**args)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.choices[0].text == one.choices[0].text
    assert len({c.text for c in many.choices}) > 1 and many.usage.completion_tokens == 18
    streamed = list(client.completions.create(**args, n=2, stream=True))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == [c.text for c in many.choices[:2]]


def sse_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


def test_the_openai_client_sees_a_bad_request_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny", prompt=[600], max_tokens=1)


def test_a_burst_past_the_queue_limit_gets_429_with_retry_after_and_the_rest_complete(url: str) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:
            body = {"model": "tiny", "prompt": [i % 500 + 5 for i in range(1500)], "max_tokens": 2, "temperature": 0}
            return await asyncio.gather(*(http.post(url + "/v1/completions", json=body) for _ in range(12)))

    answers = asyncio.run(burst())
    rejected = [r for r in answers if r.status_code == 429]
    served = [r for r in answers if r.status_code == 200]
    assert rejected and served and len(rejected) + len(served) == 12
    assert all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error" for r in rejected)
    assert len({r.json()["choices"][0]["text"] for r in served}) == 1  # same prompt, same greedy answer
    assert metric(url, 'kvtier_serving_rejections_total{reason="requests"}') == len(rejected)


def test_a_client_that_disconnects_from_a_stream_aborts_its_request(url: str) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 20000, "stream": True, "ignore_eos": True}
    aborts = metric(url, 'kvtier_serving_aborts_total{reason="disconnect"}')
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert metric(url, 'kvtier_serving_queue_depth{pool="engine"}') == 1
    wait_for(lambda: metric(url, 'kvtier_serving_queue_depth{pool="engine"}') == 0, 60, "the request's abort")
    assert metric(url, 'kvtier_serving_aborts_total{reason="disconnect"}') == aborts + 1


def test_models_health_tokenize_and_detokenize(url: str, reference) -> None:
    codec = reference[1]
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(url + "/health").status_code == 200
    tokens = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "hello store"}).json()
    assert tokens["tokens"] == codec.encode("hello store") and tokens["count"] == len(tokens["tokens"])
    assert httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hello store"}
    assert httpx.post(url + "/detokenize", json={"tokens": [9999]}).status_code == 400


def test_a_client_that_disconnects_while_waiting_for_a_whole_answer_aborts_its_request(url: str) -> None:
    body = {"model": "tiny", "prompt": "y", "max_tokens": 20000, "ignore_eos": True}
    aborts = metric(url, 'kvtier_serving_aborts_total{reason="disconnect"}')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=3)
    wait_for(lambda: metric(url, 'kvtier_serving_queue_depth{pool="engine"}') == 0, 60, "the request's abort")
    assert metric(url, 'kvtier_serving_aborts_total{reason="disconnect"}') == aborts + 1


def test_a_store_that_is_down_costs_reuse_never_a_request(start_server, checkpoint: Path, tmp_path: Path) -> None:
    from kvtier.kvstore.cluster import config as cluster_mod

    down = cluster_mod.write_default(tmp_path, nodes=12, capacity_bytes=64 << 20)  # no node is started
    url = start_server("--checkpoint", str(checkpoint), "--store", str(down), "--model", "tiny")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    ids = [(i * 7 + 3) % 500 + 5 for i in range(420)]
    answers = [client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0) for _ in range(2)]
    assert [a.usage.prompt_tokens_details.cached_tokens for a in answers] == [0, 0]
    assert answers[0].choices[0].text == answers[1].choices[0].text


def test_an_8_mb_prompt_and_a_deep_json_leave_a_running_stream_and_health_on_time(url: str) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2000, "stream": True, "ignore_eos": True, "temperature": 0}
    stamps: list[float] = []

    def read() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(3)  # the stream is under way
    heavy = [
        json.dumps({"model": "tiny", "prompt": "word " * ((8 << 20) // 5)}).encode(),  # 8 MB of text
        json.dumps({"model": "tiny", "prompt": "word " * 78_000}).encode(),  # tokenized: longer than the context
        b'{"model": "tiny", "prompt": "x", "y": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",  # 200,000 levels deep
    ]

    async def abuse() -> tuple[list[int], float]:
        async with httpx.AsyncClient(timeout=300) as http:
            posts = asyncio.gather(*(http.post(url + "/v1/completions", content=b) for b in heavy))
            worst = 0.0
            while not posts.done():
                began = time.monotonic()
                assert (await http.get(url + "/health")).status_code == 200
                worst = max(worst, time.monotonic() - began)
                await asyncio.sleep(0.1)
            return [r.status_code for r in await posts], worst

    began = time.monotonic()
    statuses, worst_health = asyncio.run(abuse())
    ended = time.monotonic()
    assert statuses == [400, 400, 400]
    gaps = [b - a for a, b in itertools.pairwise(stamps) if began <= b <= ended + 1]
    assert worst_health < 2.0 and gaps and max(gaps) < 2.0  # (the 8 MB prompt stalled both for 17 s)
