"""Choosing tokens: every parameter users rely on changes the choice as vLLM's sampler does (logit bias, min-tokens,
the three penalties, then temperature, min-p, top-k and top-p), logprobs are those of the raw logits, and a choice
stays a pure function of the logits, the settings, the token's index and the tokens before it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvtier.engine.engine import Engine
from kvtier.engine.sampling import Sampling, sample, token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# token:          0    1    2    3     4     5
LOGITS = torch.tensor([3.0, 2.5, 1.0, -1.0, -2.0, 0.5])


def test_a_logit_bias_of_minus_100_moves_greedy_off_its_token() -> None:
    assert sample(LOGITS, Sampling(), 0) == 0
    assert sample(LOGITS, Sampling(logit_bias=((0, -100.0),)), 0) == 1
    assert sample(LOGITS, Sampling(logit_bias=((4, 6.0),)), 0) == 4


def test_min_tokens_keeps_stop_tokens_out_until_enough_tokens_are_made() -> None:
    s = Sampling(stop_token_ids=frozenset({0}), min_tokens=2)
    assert [sample(LOGITS, s, i) for i in range(3)] == [1, 1, 0]


def test_presence_and_frequency_penalties_count_the_answer_not_the_prompt() -> None:
    assert sample(LOGITS, Sampling(presence_penalty=1.0), 1, prompt=[0, 0], generated=[2]) == 0
    assert sample(LOGITS, Sampling(presence_penalty=1.0), 1, prompt=[], generated=[0]) == 1
    once, twice = [0], [0, 0]
    assert sample(LOGITS, Sampling(frequency_penalty=0.3), 1, generated=once) == 0  # 3.0 - 0.3 > 2.5
    assert sample(LOGITS, Sampling(frequency_penalty=0.3), 2, generated=twice) == 1  # 3.0 - 0.6 < 2.5


def test_the_repetition_penalty_divides_seen_positive_logits_and_multiplies_seen_negative_ones() -> None:
    assert sample(LOGITS, Sampling(repetition_penalty=2.0), 0, prompt=[0]) == 1  # 3.0 / 2 < 2.5
    assert sample(LOGITS, Sampling(repetition_penalty=4.0), 2, prompt=[5], generated=[0, 1]) == 2  # 0.75, 0.625 < 1
    negative = torch.tensor([-1.0, -1.5])
    assert sample(negative, Sampling(repetition_penalty=2.0), 0, prompt=[0]) == 1  # -1.0 * 2 < -1.5


def test_top_k_of_one_at_temperature_one_is_greedy() -> None:
    picks = {sample(LOGITS, Sampling(temperature=1.0, top_k=1, seed=s), 0) for s in range(30)}
    assert picks == {0}
    assert len({sample(LOGITS, Sampling(temperature=1.0, seed=s), 0) for s in range(30)}) > 1


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_most_likely() -> None:
    # at T=1, p(1)/p(0) = e^-0.5 = 0.61, p(2)/p(0) = e^-2 = 0.14: min_p 0.5 keeps tokens 0 and 1 only
    picks = {sample(LOGITS, Sampling(temperature=1.0, min_p=0.5, seed=s), 0) for s in range(60)}
    assert picks == {0, 1}


def test_logprobs_are_the_raw_logits_log_softmax_with_the_top_ones_in_order() -> None:
    logprob, top = token_logprobs(LOGITS, 2, 3)
    expected = torch.log_softmax(LOGITS, -1)
    assert math.isclose(logprob, float(expected[2]), rel_tol=1e-6)
    assert [t for t, _ in top] == [0, 1, 2] and all(math.isclose(lp, float(expected[t])) for t, lp in top)
    assert token_logprobs(LOGITS, 5, 0)[1] == []


@pytest.mark.parametrize(
    "settings",
    [
        {"top_k": 3},
        {"min_p": 0.05},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"repetition_penalty": 1.3},
        {"logit_bias": ((7, 5.0), (8, -3.0))},
        {"top_k": 40, "top_p": 0.9, "min_p": 0.01, "repetition_penalty": 1.1},
    ],
    ids=["top-k", "min-p", "presence-frequency", "repetition", "logit-bias", "all"],
)
def test_a_seeded_choice_is_a_pure_function_of_logits_seed_index_and_history(settings: dict, checkpoint: Path) -> None:
    logits = Engine.from_pretrained(checkpoint).logits(list(range(5, 60)))[-1]
    s = Sampling(temperature=0.9, seed=11, **settings)
    history = {"prompt": list(range(5, 60)), "generated": [9, 9, 30]}
    assert sample(logits, s, 3, **history) == sample(logits.clone(), s, 3, **history)
    assert len({sample(logits, Sampling(temperature=1.5, seed=seed, **settings), 0, **history)
                for seed in range(40)}) > 1  # fmt: skip


def test_settings_out_of_range_are_refused_in_one_line() -> None:
    for bad in ({"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"min_tokens": -1},
                {"presence_penalty": 3.0}, {"logprobs": -1}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(**bad)
