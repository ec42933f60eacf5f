"""How far an approximate prefill's output is from the exact one, over a seeded prompt set: what ``swa-replay`` (bounded
replay) and ``kv-format`` (low-precision KV) report.

Per prompt (:func:`compare`): the first token's max |Δlogit|; the exact run's top-2 margin there and whether the error
could swap the top two (a **near tie**: margin below twice the error); greedy agreement over the generated tokens
(positions equal, the common prefix) and, where the runs part, the exact logits' top-2 margin at that position. Over
the set (:func:`summarize`): the error's median, p90 and max, near ties, prompts diverged (at the first token too),
the largest margin where one diverged, and the token agreement. An approximation that errs by ε diverges wherever the
exact top two are closer than ε: agreement over a few prompts says little; run many and read the margins.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.tools.kvbench.common import UsageError


def lengths(text: str, prompts: int) -> list[int]:
    """``--lengths MIN-MAX``: ``prompts`` lengths spread evenly (UsageError, one line, for anything else)."""
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise UsageError(f"--lengths {text!r}: use MIN-MAX in tokens, e.g. 700-2500") from None
    if not 0 < lo <= hi:
        raise UsageError(f"--lengths {text!r}: need 0 < MIN <= MAX")
    return np.linspace(lo, hi, prompts).astype(int).tolist()


def margin(logits: Any) -> float:
    """The gap between the largest and second largest logit."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def compare(approx: Any, exact: Any, logits: Callable[[list[int]], Any], prompt: list[int]) -> dict[str, Any]:
    """One prompt's row: ``approx`` and ``exact`` are engine Results (``first_logits``, ``tokens``) for ``prompt``;
    ``logits``: a whole exact forward's logits of a token list (asked only where the runs part)."""
    same = [a == b for a, b in zip(approx.tokens, exact.tokens, strict=True)]
    common = same.index(False) if False in same else len(same)
    error = (approx.first_logits - exact.first_logits).abs().max().item()
    top2 = margin(exact.first_logits)
    return {
        "hit_tokens": approx.hit_tokens,
        "max_abs_dlogit": error,
        "top2_margin": top2,
        "near_tie": top2 < 2 * error,
        "tokens_equal": sum(same),
        "common_prefix": common,
        # the exact run's top-2 margin where the two continuations part (None: they never do)
        "margin_at_divergence": None if common == len(same) else margin(logits(prompt + exact.tokens[:common])[-1]),
    }


def summarize(rows: list[dict[str, Any]], new_tokens: int) -> dict[str, Any]:
    """The rows' distribution (see the module docstring)."""
    errors = sorted(r["max_abs_dlogit"] for r in rows)
    diverged = [r for r in rows if r["margin_at_divergence"] is not None]
    return {
        "max_abs_dlogit_max": errors[-1],
        "max_abs_dlogit_median": statistics.median(errors),
        "max_abs_dlogit_p90": errors[min(len(errors) - 1, int(0.9 * len(errors)))],
        "top2_margin_min": min(r["top2_margin"] for r in rows),
        "near_ties": sum(r["near_tie"] for r in rows),
        "first_token_diverged": sum(r["common_prefix"] == 0 for r in rows),
        "diverged": len(diverged),
        "margin_at_divergence_max": max((r["margin_at_divergence"] for r in diverged), default=None),
        "token_agreement": sum(r["tokens_equal"] for r in rows) / (len(rows) * new_tokens),
    }


def header() -> str:
    return f"{'prompt':>7} {'hit':>6} {'max|Δlogit|':>12} {'top-2 margin':>13} {'equal':>7} {'common prefix':>14}"


def line(r: dict[str, Any], new_tokens: int) -> str:
    tie = " near tie" if r["near_tie"] else ""
    parted = "" if r["margin_at_divergence"] is None else f" (margin there {r['margin_at_divergence']:.4f})"
    return (
        f"{r['prompt_tokens']:>7} {r['hit_tokens']:>6} {r['max_abs_dlogit']:>12.4f} {r['top2_margin']:>13.4f} "
        f"{r['tokens_equal']:>4}/{new_tokens:<2} {r['common_prefix']:>14}{parted}{tie}"
    )


def summary_lines(s: dict[str, Any], prompts: int, new_tokens: int) -> list[str]:
    diverged = s["diverged"]
    where = (
        f", where the exact logits' top two were at most {s['margin_at_divergence_max']:.4f} apart" if diverged else ""
    )
    return [
        f"max |Δlogit|: median {s['max_abs_dlogit_median']:.4f}, p90 {s['max_abs_dlogit_p90']:.4f}, "
        f"max {s['max_abs_dlogit_max']:.4f}; smallest top-2 margin {s['top2_margin_min']:.4f}, "
        f"below twice the error (near ties) in {s['near_ties']} of {prompts}",
        f"greedy agreement {s['token_agreement']:.1%}: {diverged} of {prompts} prompts diverged within {new_tokens} "
        f"tokens ({s['first_token_diverged']} at the first token){where}",
    ]
