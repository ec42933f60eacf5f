"""The engine's worker loop in-process: every request it holds advances a step at a time, streamed tokens and
answers equal ``generate``'s, chunked prefill under a step budget changes nothing, aborts release their pages,
and a request waits for cache pages rather than failing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.engine import Engine
from kvtier.engine.sampling import Sampling, sample, token_logprobs
from kvtier.engine.worker import WorkerLoop
from kvtier.serving.cost import CostModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 31 + seed * 17) % 500 + 5 for i in range(n)]


def run(engine: Engine, requests: list[dict[str, Any]], role: str = "both", **kw: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    loop = WorkerLoop(engine, role, events.append, **kw)
    for r in requests:
        loop.submit(r)
    loop.submit(None)
    loop.run()
    return events


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    return Engine.from_pretrained(checkpoint)


def test_concurrent_requests_stream_the_same_tokens_as_generate(engine: Engine) -> None:
    prompts = [prompt(300, 1), prompt(700, 2), prompt(40, 3)]
    events = run(engine, [{"id": i, "prompt": p, "max_new_tokens": 6, "stream": True} for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        expected = engine.generate([p], 6, reuse=False)[0].tokens
        assert [e["token"] for e in events if e.get("id") == i and "token" in e] == expected
        assert next(e for e in events if e.get("id") == i and "tokens" in e)["tokens"] == expected
    assert engine.cache.free_pages == engine.cache.num_pages


def started(engine: Engine, requests: list[dict[str, Any]], **kw: Any) -> tuple[WorkerLoop, list[dict[str, Any]]]:
    """A worker loop that took ``requests`` and admitted them, not stepped yet; and its events."""
    events: list[dict[str, Any]] = []
    loop = WorkerLoop(engine, "both", events.append, **kw)
    for r in requests:
        loop.submit(r)
    loop._take(0.0)
    loop._start_waiting()
    return loop, events


ONE_CHUNK_A_STEP = CostModel(0.0, 1.0, 0.0)  # a second a token: in a budget of 0 s only the step's first chunk runs


def test_chunked_prefill_under_a_step_budget_gives_the_same_answer(engine: Engine) -> None:
    p = prompt(1500, 4)
    loop, events = started(engine, [{"id": "a", "prompt": p, "max_new_tokens": 4}], cost=ONE_CHUNK_A_STEP)
    computed = []
    while loop.running:
        loop._step()
        computed.append(loop.running["a"].generation.computed if loop.running else None)
    assert computed[:3] == [512, 1024, 1500]  # three steps of one 512-token chunk (the last is what is left)
    assert events[-1]["tokens"] == engine.generate([p], 4, reuse=False)[0].tokens


def test_a_short_prompt_is_computed_before_a_long_one_that_came_first(engine: Engine) -> None:
    requests = [{"id": "long", "prompt": prompt(2000, 5), "max_new_tokens": 1},
                {"id": "short", "prompt": prompt(100, 6), "max_new_tokens": 1}]  # fmt: skip
    loop, events = started(engine, requests, cost=ONE_CHUNK_A_STEP)
    loop._step()
    assert [e["id"] for e in events] == ["short"] and loop.running["long"].generation.computed is None
    loop.submit(None)
    loop.run()


def test_an_abort_releases_a_running_request_and_answers_once(engine: Engine) -> None:
    events: list[dict[str, Any]] = []
    loop = WorkerLoop(engine, "both", events.append)
    loop.submit({"id": "x", "prompt": prompt(200, 7), "max_new_tokens": 10_000, "stream": True})
    loop._take(None)
    loop._start_waiting()
    for _ in range(3):
        loop._step()
    loop.submit({"abort": "x"})
    loop.submit({"abort": "never-seen"})
    loop.submit(None)
    loop.run()
    assert [e for e in events if "token" not in e] == [{"id": "x", "aborted": True}]
    assert engine.cache.free_pages == engine.cache.num_pages


def test_a_request_waits_for_pages_instead_of_failing(checkpoint: Path) -> None:
    small = Engine.from_pretrained(checkpoint, cache_tokens=640)  # 10 pages of 64 tokens
    requests = [{"id": i, "prompt": prompt(200, 10 + i), "max_new_tokens": 100} for i in range(3)]  # 5 pages each
    events = run(small, requests)
    assert sorted(e["id"] for e in events) == [0, 1, 2] and all("tokens" in e for e in events)
    assert [e["id"] for e in events][-1] == 2  # it started when one of the first two finished
    too_big = run(small, [{"id": "big", "prompt": prompt(700, 1), "max_new_tokens": 100}])
    assert too_big == [{"id": "big", "error": too_big[0]["error"]}] and "cache holds 640" in too_big[0]["error"]


def test_an_answer_that_outgrows_the_whole_cache_ends_there_with_length(checkpoint: Path) -> None:
    small = Engine.from_pretrained(checkpoint, cache_tokens=640)
    p = prompt(600, 1)
    [answer] = run(small, [{"id": "big", "prompt": p, "max_new_tokens": 100}])
    assert (len(answer["tokens"]), answer["finish_reason"]) == (41, "length")  # positions 600…639 fit, and the 41st
    assert answer["tokens"] == small.generate([p], 41, reuse=False)[0].tokens


def test_bad_requests_are_one_error_line_each(engine: Engine) -> None:
    events = run(engine, ['{"id": 1, "prompt": "text"}', "not json", '{"id": 2, "prompt": [1], "max_new_tokens": -1}',
                          '{"id": 3, "prompt": [9999]}'])  # fmt: skip
    assert [e["id"] for e in events] == [1, None, 2, 3] and all("error" in e for e in events)
    assert "outside" in events[3]["error"] or "0…511" in events[3]["error"]


def test_sampling_is_a_pure_function_of_seed_and_index(engine: Engine) -> None:
    logits = engine.logits(prompt(50, 9))[-1]
    s = Sampling(temperature=0.9, top_p=0.8, seed=5)
    assert sample(logits, s, 3) == sample(logits, s, 3)
    assert len({sample(logits, Sampling(1.5, 1.0, seed), 0) for seed in range(40)}) > 1
    assert sample(logits, Sampling(), 0) == int(logits.argmax())
    assert sample(logits, Sampling(2.0, top_p=1e-9, seed=1), 0) == int(logits.argmax())  # top_p keeps one token


SETTINGS = {"temperature": 0.8, "seed": 3, "top_k": 20, "min_p": 0.02, "logit_bias": {"7": 4.0, "9": -100.0},
            "presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.2, "min_tokens": 3}  # fmt: skip


def as_sampling(settings: dict[str, Any]) -> Sampling:
    bias = tuple((int(k), v) for k, v in settings.get("logit_bias", {}).items())
    return Sampling(**{**settings, "logit_bias": bias})


def test_every_sampling_setting_of_a_request_reaches_its_tokens(engine: Engine) -> None:
    p = prompt(120, 11)
    [answer] = run(engine, [{"id": 1, "prompt": p, "max_new_tokens": 12, **SETTINGS}])
    assert answer["tokens"] == engine.generate([p], 12, reuse=False, sampling=as_sampling(SETTINGS))[0].tokens
    plain = engine.generate([p], 12, reuse=False, sampling=Sampling(0.8, seed=3))[0].tokens
    assert answer["tokens"] != plain


def test_a_decode_worker_given_the_first_token_continues_every_setting_as_one_process(engine: Engine) -> None:
    p = prompt(150, 12)
    for settings in (SETTINGS, {**SETTINGS, "temperature": 0.0}, {"repetition_penalty": 1.5}):
        [whole] = run(engine, [{"id": 1, "prompt": p, "max_new_tokens": 10, **settings}])
        [first] = run(engine, [{"id": 1, "prompt": p, **settings}], role="prefill")
        [rest] = run(engine, [{"id": 1, "prompt": p, "max_new_tokens": 10, "first_token": first["first_token"],
                               **settings}], role="decode")  # fmt: skip
        assert rest["tokens"] == whole["tokens"]
        assert whole["tokens"] == engine.generate([p], 10, reuse=False, sampling=as_sampling(settings))[0].tokens


def test_streamed_tokens_carry_the_logprobs_of_the_raw_logits(engine: Engine) -> None:
    p = prompt(90, 13)
    events = run(engine, [{"id": 1, "prompt": p, "max_new_tokens": 4, "stream": True, "logprobs": 2}])
    tokens = [e for e in events if "token" in e]
    assert len(tokens) == 4 and all(len(e["top_logprobs"]) == 2 for e in tokens)
    expected, top = token_logprobs(engine.logits(p)[-1], tokens[0]["token"], 2)
    assert tokens[0]["logprob"] == pytest.approx(expected, abs=1e-4)
    assert [t for t, _ in tokens[0]["top_logprobs"]] == [t for t, _ in top]
    assert events[-1]["logprobs"] == [[e["logprob"], e["top_logprobs"]] for e in tokens]
    [first] = run(engine, [{"id": 1, "prompt": p, "logprobs": 2}], role="prefill")
    assert first["logprobs"] == events[-1]["logprobs"][:1]


def test_a_logit_bias_outside_the_vocabulary_is_one_error_line(engine: Engine) -> None:
    [answer] = run(engine, [{"id": 1, "prompt": prompt(10, 1), "logit_bias": {"512": 1.0}}])
    assert "logit_bias" in answer["error"]


def test_no_more_than_max_running_requests_run_at_once(engine: Engine) -> None:
    requests = [{"id": i, "prompt": prompt(60, 20 + i), "max_new_tokens": 3, "stream": True} for i in range(3)]
    events = run(engine, requests, max_running=1)
    order = [e["id"] for e in events]
    assert order == [0] * 4 + [1] * 4 + [2] * 4  # three tokens and the answer of each, one request after another
