"""The decode balancer: balance request count and total KV length at once.

A decode replica's step time grows with the requests it runs (each computes a token) and with the KV they hold
(each token attends to its own cache): ``d(n, kv) = a + b·n + g·kv`` (``serving.cost``). A request of ``L``
tokens placed on replica ``i`` makes its loads ``n_i + 1`` and ``kv_i + L``. Two rules, in order:

1. **Balance both dimensions.** Each load is compared with the cluster's mean after the placement, and a
   replica is a candidate when its larger ratio is within ``slack`` (25 %) of the best replica's:

       ratio_i = max((n_i + 1) / n̄,  (kv_i + L) / kv̄)      n̄ = (Σn + 1) / R,  kv̄ = (Σkv + L) / R

   so no replica is loaded far past the mean in either requests or KV.
2. **Slow the fewest tokens.** Among the candidates, the one where the placement adds the least step time summed
   over the requests it delays, ``n_i·(b + g·L)`` (its running requests each wait ``b + g·L`` longer a token)
   plus the request's own step ``d(n_i + 1, kv_i + L)``. So a short request goes to a replica with few requests
   even if its caches are long, and a long one to where its KV slows the fewest requests, unless that replica's
   KV is already far above the mean (rule 1), when it goes to one with little cached KV.

3. **Keep what can meet the TBT SLO within it** (only with ``tbt_slo_s``). When the choice would make its replica
   step slower than the SLO, every request there misses it. Then, in order: a replica whose step stays within
   the SLO with the request takes it (the one rule 2 prefers); else, when every replica would pass the SLO, the
   most loaded of those already past it takes it, as long as its step stays within ``SACRIFICE_CAP`` (1.25×) of
   the mean step after placement: its requests miss the SLO anyway, and the others keep meeting it (goodput);
   the cap bounds the imbalance that costs (a replica far past the others slows its requests without end);
   else rules 1–2's choice stands.

Ties go to the smaller ratio, then the lower id. Without a fitted cost model (``b = g = 0``) rule 2 ties and
rule 1's best ratio decides, and rule 3 never applies (every step is "0 s"). No cache affinity: every replica
reads the same store. The worked examples are in docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.serving.cost import CostModel

SLACK = 0.25
SACRIFICE_CAP = 1.25


def ratios(requests: Sequence[int], kv_tokens: Sequence[int], length: int) -> list[float]:
    """Rule 1's ``ratio_i`` per replica for a request of ``length`` tokens."""
    r = len(requests)
    n_mean = (sum(requests) + 1) / r
    kv_mean = (sum(kv_tokens) + length) / r
    return [max((n + 1) / n_mean, (kv + length) / kv_mean if kv_mean else 0.0)
            for n, kv in zip(requests, kv_tokens, strict=True)]  # fmt: skip


def added_step_s(n: int, kv: int, length: int, cost: CostModel) -> float:
    """Rule 2: step time the placement adds, summed over the replica's requests and the new one."""
    return n * (cost.decode_b + cost.decode_g * length) + cost.decode_s(n + 1, kv + length)


def pick_decode(
    requests: Sequence[int], kv_tokens: Sequence[int], length: int, cost: CostModel | None = None,
    slack: float = SLACK, tbt_slo_s: float | None = None,
) -> int:  # fmt: skip
    """The replica for a request of ``length`` tokens (prompt plus its answer so far), given each replica's
    running ``requests`` and the ``kv_tokens`` they hold (see the module doc; ``tbt_slo_s`` turns on rule 3)."""
    if not requests:
        raise ValueError("no decode replicas")
    score = ratios(requests, kv_tokens, length)
    best = min(score)
    candidates = [i for i in range(len(score)) if score[i] <= best * (1 + slack)]
    if cost is None:
        return min(candidates, key=lambda i: (score[i], i))
    added = [added_step_s(n, kv, length, cost) for n, kv in zip(requests, kv_tokens, strict=True)]
    choice = min(candidates, key=lambda i: (added[i], score[i], i))
    if tbt_slo_s is None:
        return choice
    return _within_slo(requests, kv_tokens, length, cost, tbt_slo_s, choice, added)


def _within_slo(
    requests: Sequence[int], kv_tokens: Sequence[int], length: int, cost: CostModel, tbt_slo_s: float, choice: int,
    added: Sequence[float],
) -> int:  # fmt: skip
    """Rule 3 of the module doc, given rules 1–2's ``choice`` and rule 2's ``added`` step per replica."""
    now = [cost.decode_s(n, kv) for n, kv in zip(requests, kv_tokens, strict=True)]
    after = [cost.decode_s(n + 1, kv + length) for n, kv in zip(requests, kv_tokens, strict=True)]
    if after[choice] <= tbt_slo_s:
        return choice
    within = [i for i in range(len(after)) if after[i] <= tbt_slo_s]
    if within:
        return min(within, key=lambda i: (added[i], i))
    mean_after = (sum(now) - now[choice] + after[choice]) / len(now)
    lost = [i for i in range(len(now)) if now[i] > tbt_slo_s and after[i] <= SACRIFICE_CAP * mean_after]
    return max(lost, key=lambda i: (now[i], -i)) if lost else choice
