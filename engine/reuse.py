"""The hit rule: how much of a prompt's KV to reuse, and whether the sliding state is exact or replayed.

For a prompt of ``L`` tokens whose first ``block_hit`` tokens have block KV in the store:

- **no sliding layers**: reuse ``h`` = the largest block boundary ``≤ min(block_hit, L-1)`` (the last prompt
  token is always computed, so there are logits to sample from); exact.
- **sliding layers** (window ``W``): ``h`` = the largest multiple of ``lcm(128, block_tokens)`` with
  ``h ≤ min(block_hit, L - (W + 6))``. A StateBlock for ``prefix[:h]`` → **exact** reuse; none → **bounded
  replay** of positions ``h-W … h-1`` (approximate; nothing computed from it is stored). ``h = 0``: no reuse.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvtier.engine.sliding import SPECULATIVE_POSITIONS, STATE_INTERVAL


class Reuse(Enum):
    NONE = "none"
    EXACT = "exact"
    REPLAY = "replay"


@dataclass(frozen=True)
class Plan:
    hit_tokens: int
    reuse: Reuse


def plan(
    prompt_len: int,
    block_hit_tokens: int,
    block_tokens: int,
    window: int | None,
    has_state: Callable[[int], bool],
    resume: bool = False,
    margin: int | None = None,
) -> Plan:
    """Apply the hit rule; ``has_state(h)`` says whether a StateBlock for ``prefix[:h]`` exists.

    ``window``: the model keeps StateBlocks (None: it keeps nothing outside its pages). ``margin``: the hit leaves
    at least this many prompt tokens to compute (default ``window + 6``, the dense families' rule; DeepSeek-V4's
    StateBlock resumes exactly at the hit, so its margin is 1).

    ``resume``: the decode worker's rule (P/D). The prefill worker stored every full block of this prompt and a
    StateBlock at its last block boundary before the final token, so reuse up to there (exact) and recompute at
    most the last block; without that StateBlock, the prefill rule.
    """
    last = min(block_hit_tokens, prompt_len - 1) // block_tokens * block_tokens
    if window is None:
        return Plan(last, Reuse.EXACT if last > 0 else Reuse.NONE)
    if resume and last and has_state(last):
        return Plan(last, Reuse.EXACT)
    step = math.lcm(STATE_INTERVAL, block_tokens)
    margin = window + SPECULATIVE_POSITIONS if margin is None else margin
    h = max(0, min(block_hit_tokens, prompt_len - margin)) // step * step
    if h == 0:
        return Plan(0, Reuse.NONE)
    return Plan(h, Reuse.EXACT if has_state(h) else Reuse.REPLAY)
