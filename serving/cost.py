"""The step cost model ``t(q, c)``: seconds for a prefill step that computes ``q`` new tokens of a sequence whose
first ``c`` tokens are already in the cache, and the largest chunk that fits a step's time budget.

    t(q, c) = a + b·q + g·q·(c + (q + 1) / 2)

``a`` is a step's fixed cost, ``b·q`` the per-token work (projections, MLP), and the last term attention: new
token ``i`` attends to ``c + i`` keys, ``Σ_{i=1..q} (c + i) = q·c + q(q+1)/2``; quadratic in the attention term.
The decode step of a replica is the same model seen from the other side: ``d(n, kv) = a + b·n + g·kv`` for ``n``
running requests holding ``kv`` cached tokens in all (each computes one token attending to its own cache).

``fit`` finds the coefficients by least squares over measured steps (``kvbench fit-cost`` measures them) and
reports the fit's error; the fitted model is a small JSON file the server and ``kvbench route`` both read.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MAX_CHUNK_TOKENS = 32_768


@dataclass(frozen=True)
class CostModel:
    """``t(q, c)`` for prefill steps and ``d(n, kv)`` for decode steps, in seconds (see the module doc)."""

    a: float
    b: float
    g: float
    decode_a: float = 0.0
    decode_b: float = 0.0
    decode_g: float = 0.0
    rel_error: float = 0.0  # RMS of (measured − predicted) / measured over the steps it was fitted on
    max_rel_error: float = 0.0

    def prefill_s(self, q: int, c: int) -> float:
        """Predicted seconds to compute ``q`` new tokens after ``c`` cached ones (0 for ``q`` = 0)."""
        return self.a + self.b * q + self.g * q * (c + (q + 1) / 2) if q > 0 else 0.0

    def decode_s(self, n: int, kv: int) -> float:
        """Predicted seconds of one decode step of ``n`` requests holding ``kv`` cached tokens (0 when idle)."""
        return self.decode_a + self.decode_b * n + self.decode_g * kv if n > 0 else 0.0

    def largest_chunk(self, left: int, c: int, time_left_s: float, granule: int = 1) -> int:
        """The most new tokens, at most ``min(left, MAX_CHUNK_TOKENS)``, whose step fits ``time_left_s`` after
        ``c`` cached tokens: a multiple of ``granule`` or all of ``left``; 0 when not even one granule fits."""
        limit = min(left, MAX_CHUNK_TOKENS)
        if self.prefill_s(limit, c) <= time_left_s:
            return limit
        budget = time_left_s - self.a
        if budget <= 0:
            return 0
        # g/2·q² + (b + g·c + g/2)·q − budget ≤ 0: the positive root is the largest real q that fits
        half_g, lin = self.g / 2, self.b + self.g * c + self.g / 2
        q = budget / lin if half_g == 0 else (-lin + math.sqrt(lin * lin + 4 * half_g * budget)) / (2 * half_g)
        return min(limit, int(q) // granule * granule)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A model written by :meth:`save`; ValueError (one line) for a file that is not one."""
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path}: not a cost model file ({e})") from None


def fit(prefill: list[tuple[int, int, float]], decode: list[tuple[int, int, float]] = ()) -> CostModel:
    """Least-squares coefficients (non-negative) from measured ``(q, c, seconds)`` prefill steps and
    ``(n, kv, seconds)`` decode steps; the reported error is the prefill fit's. Needs 3 prefill steps."""
    if len(prefill) < 3:
        raise ValueError("fitting t(q, c) needs at least 3 measured steps")
    q, c, t = (np.array(col, dtype=np.float64) for col in zip(*prefill, strict=True))
    a, b, g = _nnls(np.stack([np.ones_like(q), q, q * (c + (q + 1) / 2)], axis=1), t)
    model = CostModel(a, b, g)
    predicted = np.array([model.prefill_s(int(x), int(y)) for x, y in zip(q, c, strict=True)])
    rel = (t - predicted) / t
    da = db = dg = 0.0
    if len(decode) >= 3:
        n, kv, dt = (np.array(col, dtype=np.float64) for col in zip(*decode, strict=True))
        da, db, dg = _nnls(np.stack([np.ones_like(n), n, kv], axis=1), dt)
    return CostModel(a, b, g, da, db, dg, float(np.sqrt(np.mean(rel**2))), float(np.max(np.abs(rel))))


def _nnls(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares with every coefficient ≥ 0 (a negative one is dropped and the rest refitted): weighted by
    1/y so that short steps count as much as long ones (the error reported is relative)."""
    w = 1 / y
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return tuple(float(v) for v in coef)  # type: ignore[return-value]
        active.remove(min(negative, key=lambda i: coef[i]))
