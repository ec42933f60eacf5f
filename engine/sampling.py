"""Choosing the next token from logits: greedy, or sampled, as a pure function of ``(logits, settings, index,
tokens before it)``.

The logits are adjusted in vLLM's order before anything is chosen: stop tokens masked while fewer than
``min_tokens`` were made, ``logit_bias`` added, then the penalties (repetition over the prompt and the answer so far,
frequency and presence over the answer). Temperature 0 is the argmax of what is left. Otherwise: softmax of the
adjusted logits over ``temperature`` in float64, tokens under ``min_p`` × the most likely one's probability dropped,
tokens sorted by probability (ties by id), the first ``top_k`` kept, of those the smallest leading set whose mass
reaches ``top_p``, and the token where the kept mass's running sum first passes ``u × kept mass``.

``u`` is drawn from ``numpy.random.default_rng([seed, index])``, where ``index`` is the token's place in the answer
(0 for the first). Nothing is carried from one token to the next but the tokens themselves, so the same seed gives
the same answer in one process or split across a prefill and a decode worker (the decode worker takes the prefill
worker's first token and samples from index 1 with it in the answer), and a request can be resumed anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

MAX_LOGPROBS = 20  # alternatives reported per token at most (vLLM's default max_logprobs)


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens (the module doc says in which order each setting acts). ``temperature`` 0 is
    greedy (``seed``, ``top_*`` and ``min_p`` unused). ``top_k`` 0 keeps every token. Generation stops after a token
    of ``stop_token_ids`` (finish reason ``"stop"``; the token is part of the answer), never before ``min_tokens``
    tokens. ``logprobs``: how many alternatives to report with each token's log-probability (None: no logprobs)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0: every token), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in 0…{MAX_LOGPROBS}, got {self.logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def adjusts(self) -> bool:
        """Whether anything changes the logits before the choice (else greedy is the raw argmax)."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
        )


GREEDY = Sampling()


def sample(
    logits: torch.Tensor,
    sampling: Sampling,
    index: int,
    prompt: Sequence[int] | np.ndarray = (),
    generated: Sequence[int] = (),
) -> int:
    """The token chosen from ``logits`` [vocab] for the answer's ``index``-th token, after ``prompt`` and the
    answer's ``generated`` tokens so far (see the module doc)."""
    if not sampling.adjusts and sampling.temperature == 0:
        return int(logits.argmax())
    scores = _adjusted(logits, sampling, index, prompt, generated)
    if sampling.temperature == 0:
        return int(scores.argmax())
    probs = torch.softmax(scores / sampling.temperature, dim=-1)
    if sampling.min_p:
        probs = torch.where(probs < sampling.min_p * probs.max(), 0.0, probs)
    order = torch.sort(probs, descending=True, stable=True).indices
    ranked = probs[order].numpy()
    running = np.cumsum(ranked)
    candidates = int(np.count_nonzero(ranked)) if sampling.min_p else len(ranked)
    candidates = max(1, min(candidates, sampling.top_k or candidates))
    mass = running[candidates - 1]
    kept = min(candidates, int(np.searchsorted(running[:candidates], sampling.top_p * mass)) + 1)  # at least one
    u = np.random.default_rng([sampling.seed & (1 << 64) - 1, index]).random()
    pick = int(np.searchsorted(running[:kept], u * running[kept - 1], side="right"))
    return int(order[min(pick, kept - 1)])


def _adjusted(
    logits: torch.Tensor, sampling: Sampling, index: int, prompt: Sequence[int] | np.ndarray, generated: Sequence[int]
) -> torch.Tensor:
    """The logits in float64 on the CPU after min-tokens, bias and penalties (vLLM's order)."""
    scores = logits.detach().to("cpu", torch.float64).clone()
    vocab = scores.shape[-1]
    if index < sampling.min_tokens and sampling.stop_token_ids:
        scores[[t for t in sampling.stop_token_ids if 0 <= t < vocab]] = -torch.inf
    for token, bias in sampling.logit_bias:
        scores[token] += bias
    answer = torch.bincount(torch.as_tensor(np.asarray(generated, dtype=np.int64)), minlength=vocab)[:vocab]
    if sampling.repetition_penalty != 1:
        ids = np.asarray(prompt, dtype=np.int64)
        seen = (torch.bincount(torch.from_numpy(ids), minlength=vocab)[:vocab] > 0) | (answer > 0)
        penalised = torch.where(scores > 0, scores / sampling.repetition_penalty, scores * sampling.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if sampling.frequency_penalty or sampling.presence_penalty:
        scores -= sampling.frequency_penalty * answer + sampling.presence_penalty * (answer > 0)
    return scores


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under the raw ``logits`` (log-softmax in float32, before any setting acts, as
    vLLM reports them) and the ``top`` most likely tokens with theirs, most likely first (ties by id)."""
    logprobs = torch.log_softmax(logits.detach().float(), dim=-1)
    best: list[tuple[int, float]] = []
    if top:
        values, ids = torch.sort(logprobs, descending=True, stable=True)
        best = list(zip(ids[:top].tolist(), values[:top].tolist(), strict=True))
    return float(logprobs[token]), best
