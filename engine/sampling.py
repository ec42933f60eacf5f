"""Choosing the next token from logits: greedy, or temperature and nucleus (top-p) sampling that is a pure
function of ``(logits, settings, index)``.

A sampled token uses one uniform number drawn from ``numpy.random.default_rng([seed, index])``, where ``index`` is
the token's place in the answer (0 for the first). Nothing is carried from one token to the next, so the same
seed gives the same answer in one process or split across a prefill and a decode worker (the decode worker takes
the prefill worker's first token and samples from index 1), and a request can be resumed anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens. ``temperature`` 0 is greedy (argmax; ``top_p`` and ``seed`` unused).
    Generation stops after a token of ``stop_token_ids`` (finish reason ``"stop"``; the token is part of the
    answer)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = Sampling()


def sample(logits: torch.Tensor, sampling: Sampling, index: int) -> int:
    """The token chosen from ``logits`` [vocab] for the answer's ``index``-th token (see the module doc).

    Sampled: softmax of ``logits / temperature`` in float64, tokens sorted by probability (ties by id), the
    smallest leading set whose mass reaches ``top_p`` kept, and the token where the kept mass's running sum
    first passes ``u × kept mass``."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    scaled = logits.detach().to("cpu", torch.float64) / sampling.temperature
    probs = torch.softmax(scaled, dim=-1)
    order = torch.sort(probs, descending=True, stable=True).indices
    ranked = probs[order].numpy()
    running = np.cumsum(ranked)
    kept = int(np.searchsorted(running, sampling.top_p * running[-1])) + 1  # at least one token
    u = np.random.default_rng([sampling.seed & (1 << 64) - 1, index]).random()
    pick = int(np.searchsorted(running[:kept], u * running[kept - 1], side="right"))
    return int(order[min(pick, kept - 1)])
