"""Routing over prefill and decode pools, simulated: a discrete-event simulation of a trace served by ``N``
prefill engines and ``M`` decode replicas whose step times come from a fitted cost model, under one routing
policy. ``kvbench route`` is its command line; the policy ``deepinfer`` runs the server's own balancers
(``kvtier.serving.prefill_balance`` and ``decode_balance``), so the simulation measures the code that serves.

The model, stated once (docs/serving.md has it with the results):

- **Requests.** A trace line is a request arriving at ``timestamp``, with ``input_length`` prompt tokens of
  which ``cached`` come from the store and ``output_length`` tokens to generate. ``cached`` = the request's
  leading blocks seen before in the trace (``hash_ids``), scaled by the store's hit ratio at the given capacity
  over its ideal one, both from ``tools.replay`` (1 at infinite capacity), at most ``input_length − 1``.
- **Prefill engine.** A FIFO queue. Each step has a time budget; it computes chunks of the queued requests in
  order, each the largest (a multiple of 512 tokens or all that is left, at most 32,768) that the cost model
  ``t(q, c)`` predicts fits the time left, at least one chunk a step. A step lasts the sum of its chunks'
  predicted times. A request's first token comes at the end of the step that computes its last chunk:
  **TTFT** = that time − arrival.
- **Decode replica.** Runs steps back to back while it holds requests; a step makes one token for each, and
  lasts ``d(n, kv)`` for ``n`` requests holding ``kv`` tokens. A request joins at the next step boundary after
  its first token (its KV comes from the store) and leaves after ``output_length − 1`` steps. **TBT** of a
  request = (last token − first token) / (output_length − 1); TBT percentiles are over tokens (every step
  contributes its duration once per request in it).
- **Goodput** = requests whose TTFT ≤ ``ttft_slo`` and TBT ≤ ``tbt_slo``, per second of the trace's span.
- **Balance against an offline optimum with hindsight.** Prefill: the requests that arrived in each window of
  ``window_s``, with their predicted whole cost ``t(input − cached, cached)``; the policy's makespan is the
  largest sum any one engine received, the optimum a longest-first (LPT) schedule of the same requests over the
  ``N`` engines, the lower bound ``max(Σ/N, largest)``. Decode: every ``sample_s`` the step time ``d(n, kv)``
  of each replica as placed, against an LPT re-placement of the same running requests (weights
  ``d_b + d_g · kv``). A policy's balance = Σ optimum / Σ its own maximum (1.0 = as balanced as the optimum);
  decode also reports the mean of max/mean.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.serving.cost import CostModel
from kvtier.serving.decode_balance import pick_decode
from kvtier.serving.prefill_balance import DEFAULT_EDGES, PrefillBalancer
from kvtier.tools.replay import replay
from kvtier.tools.traces import DEFAULT_BLOCK_TOKENS, Request

POLICIES = ("deepinfer", "round-robin", "least-loaded")
CHUNK_GRANULE = 512
# An 8 B model on one H200 (bf16): prefill from docs/engine.md's recompute figures (1.26 s at 32K, 3.7 s at
# 77K); decode from HBM bandwidth (weights ~16 GB read a step, 32 KiB of global-layer KV a cached token).
H200_8B = CostModel(a=0.005, b=3.18e-5, g=4.03e-10, decode_a=0.008, decode_b=2e-4, decode_g=7e-9)


@dataclass
class Job:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    cached: int
    cost_s: float  # predicted whole prefill
    left: int = 0  # prompt tokens still to compute
    done_prefill: int = 0  # prompt tokens in the cache (reused + computed)
    engine: int = -1
    replica: int = -1
    first_token_s: float = math.nan
    done_s: float = math.nan
    join_step: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tbt_s(self) -> float:
        return (self.done_s - self.first_token_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class _Engine:
    queue: deque[Job] = field(default_factory=deque)
    busy: bool = False
    stepping: list[Job] = field(default_factory=list)


@dataclass
class _Replica:
    pending: list[Job] = field(default_factory=list)
    running: list[tuple[int, int, Job]] = field(default_factory=list)  # heap of (finish step, seq, job)
    n: int = 0
    kv: int = 0
    step: int = 0
    busy: bool = False


class Router:
    """One policy's choices: ``prefill(job, now, engines)`` and ``decode(job, replicas)``."""

    def __init__(
        self, policy: str, n_prefill: int, window_s: float, edges: Sequence[int], cost: CostModel, tbt_slo_s: float
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy, self.cost, self.tbt_slo_s = policy, cost, tbt_slo_s
        self.balancer = PrefillBalancer(n_prefill, window_s, edges)
        self._rr_prefill, self._rr_decode = itertools.count(), itertools.count()

    def prefill(self, job: Job, now: float, engines: list[_Engine]) -> int:
        if self.policy == "round-robin":
            return next(self._rr_prefill) % len(engines)
        if self.policy == "least-loaded":
            return min(range(len(engines)), key=lambda e: (len(engines[e].queue), e))
        return self.balancer.route(job.input_tokens, job.cost_s, now)

    def prefilled(self, job: Job) -> None:
        if self.policy == "deepinfer":
            self.balancer.done(job.engine, job.cost_s)

    def decode(self, job: Job, replicas: list[_Replica]) -> int:
        if self.policy == "round-robin":
            return next(self._rr_decode) % len(replicas)
        counts = [r.n + len(r.pending) for r in replicas]
        if self.policy == "least-loaded":
            return min(range(len(replicas)), key=lambda i: (counts[i], i))
        kv = [r.kv + sum(j.input_tokens + 1 for j in r.pending) for r in replicas]
        return pick_decode(counts, kv, job.input_tokens + 1, self.cost, tbt_slo_s=self.tbt_slo_s)


def cached_tokens(trace: Sequence[Request], block_tokens: int, capacity_tokens: int | None) -> list[int]:
    """Per request, the prompt tokens the store would supply (the module doc's definition)."""
    result = replay(trace, block_tokens, capacity_tokens)
    scale = result.token_hit_ratio / result.ideal_token_hit_ratio if result.ideal_token_hit_ratio else 0.0
    seen: set[int] = set()
    out = []
    for r in trace:
        hit = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            hit += 1
        seen.update(r.hash_ids)
        tokens = int(min(hit * block_tokens, r.input_length) * scale)
        out.append(max(0, min(tokens, r.input_length - 1)))
    return out


def simulate(
    trace: Sequence[Request],
    n_prefill: int,
    n_decode: int,
    policy: str,
    cost: CostModel = H200_8B,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    capacity_tokens: int | None = None,
    step_budget_s: float = 0.2,
    window_s: float = 10.0,
    edges: Sequence[int] = DEFAULT_EDGES,
    sample_s: float = 0.5,
    ttft_slo_s: float = 2.0,
    tbt_slo_s: float = 0.05,
) -> dict[str, Any]:
    """Serve ``trace`` under ``policy``; returns the module doc's figures as a dict (times in seconds)."""
    if n_prefill < 1 or n_decode < 1:
        raise ValueError("--prefill and --decode must be at least 1")
    if not trace:
        raise ValueError("the trace is empty")
    router = Router(policy, n_prefill, window_s, edges, cost, tbt_slo_s)
    engines = [_Engine() for _ in range(n_prefill)]
    replicas = [_Replica() for _ in range(n_decode)]
    t0 = trace[0].timestamp / 1000.0
    jobs = []
    for r, c in zip(trace, cached_tokens(trace, block_tokens, capacity_tokens), strict=True):
        q = r.input_length - c
        jobs.append(Job(r.timestamp / 1000.0 - t0, r.input_length, max(1, r.output_length), c, cost.prefill_s(q, c)))
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    for j in jobs:
        heapq.heappush(events, (j.arrival_s, next(seq), "arrive", j))
    heapq.heappush(events, (0.0, next(seq), "sample", None))
    step_samples: list[tuple[float, int]] = []  # decode step (duration, requests in it)
    decode_samples: list[tuple[float, float, float]] = []  # (policy max, optimum max, mean)
    remaining = len(jobs)

    def start_prefill(e: int, now: float) -> None:
        engine = engines[e]
        left_s, spent, chunks = step_budget_s, 0.0, 0
        engine.stepping = []
        for job in sorted(engine.queue, key=lambda j: j.left):
            while job.left > 0:
                q = cost.largest_chunk(job.left, job.done_prefill, left_s, CHUNK_GRANULE)
                if q == 0:
                    if chunks:
                        break
                    q = min(job.left, CHUNK_GRANULE)
                dt = cost.prefill_s(q, job.done_prefill)
                job.left -= q
                job.done_prefill += q
                left_s -= dt
                spent += dt
                chunks += 1
            if job.left > 0:
                break
            engine.stepping.append(job)
        engine.busy = True
        heapq.heappush(events, (now + spent, next(seq), "prefill", e))

    def start_decode(i: int, now: float) -> None:
        rep = replicas[i]
        for job in rep.pending:
            job.join_step = rep.step
            heapq.heappush(rep.running, (rep.step + job.output_tokens - 1, next(seq), job))
            rep.n += 1
            rep.kv += job.input_tokens + 1
        rep.pending = []
        if rep.n:
            rep.busy = True
            dt = cost.decode_s(rep.n, rep.kv)
            step_samples.append((dt, rep.n))
            heapq.heappush(events, (now + dt, next(seq), "decode", i))
        else:
            rep.busy = False

    def first_token(job: Job, now: float) -> None:
        nonlocal remaining
        job.first_token_s = now
        if job.output_tokens <= 1:
            job.done_s = now
            remaining -= 1
            return
        job.replica = router.decode(job, replicas)
        replicas[job.replica].pending.append(job)
        if not replicas[job.replica].busy:
            start_decode(job.replica, now)

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            job = what
            job.left, job.done_prefill = job.input_tokens - job.cached, job.cached
            job.engine = router.prefill(job, now, engines)
            engines[job.engine].queue.append(job)
            if not engines[job.engine].busy:
                start_prefill(job.engine, now)
        elif kind == "prefill":
            engine = engines[what]
            for job in engine.stepping:
                engine.queue.remove(job)
                router.prefilled(job)
                first_token(job, now)
            engine.busy = False
            if engine.queue:
                start_prefill(what, now)
        elif kind == "decode":
            rep = replicas[what]
            rep.step += 1
            rep.kv += rep.n
            while rep.running and rep.running[0][0] <= rep.step:
                _, _, job = heapq.heappop(rep.running)
                job.done_s = now
                rep.n -= 1
                rep.kv -= job.input_tokens + 1 + (rep.step - job.join_step)
                remaining -= 1
            start_decode(what, now)
        elif kind == "sample" and remaining:
            decode_samples.extend(_decode_balance(replicas, cost))
            heapq.heappush(events, (now + sample_s, next(seq), "sample", None))
    return _report(jobs, engines, step_samples, decode_samples, cost, window_s, n_prefill, ttft_slo_s, tbt_slo_s)


def _lpt(weights: Sequence[float], bins: int, fixed: float = 0.0) -> float:
    """Makespan of a longest-first schedule of ``weights`` over ``bins`` (``fixed`` added to a used bin)."""
    loads = [0.0] * bins
    used = [False] * bins
    for w in sorted(weights, reverse=True):
        i = min(range(bins), key=loads.__getitem__)
        loads[i] += w
        used[i] = True
    return max(load + (fixed if u else 0.0) for load, u in zip(loads, used, strict=True))


def _decode_balance(replicas: list[_Replica], cost: CostModel) -> list[tuple[float, float, float]]:
    times = [cost.decode_s(r.n, r.kv) for r in replicas]
    if not any(r.n for r in replicas):
        return []
    weights = []
    for r in replicas:
        for _, _, job in r.running:
            kv = job.input_tokens + 1 + (r.step - job.join_step)
            weights.append(cost.decode_b + cost.decode_g * kv)
    optimum = _lpt(weights, len(replicas), cost.decode_a)
    return [(max(times), optimum, sum(times) / len(times))]


def _percentiles(values: Sequence[float], weights: Sequence[float] | None = None) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    if weights is None:
        return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}
    order = np.argsort(v)
    cum = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    return {f"p{q}": float(v[order][np.searchsorted(cum, cum[-1] * q / 100)]) for q in (50, 90, 99)}


def _report(
    jobs: list[Job],
    engines: list[_Engine],
    steps: list[tuple[float, int]],
    decode_samples: list[tuple[float, float, float]],
    cost: CostModel,
    window_s: float,
    n_prefill: int,
    ttft_slo_s: float,
    tbt_slo_s: float,
) -> dict[str, Any]:
    span = max(jobs[-1].arrival_s, 1e-9)
    good = [j for j in jobs if j.ttft_s <= ttft_slo_s and j.tbt_s <= tbt_slo_s]
    windows: dict[int, list[Job]] = {}
    for j in jobs:
        windows.setdefault(int(j.arrival_s // window_s), []).append(j)
    policy_sum = lpt_sum = bound_sum = 0.0
    for group in windows.values():
        per_engine = [0.0] * n_prefill
        for j in group:
            per_engine[j.engine] += j.cost_s
        costs = [j.cost_s for j in group]
        policy_sum += max(per_engine)
        lpt_sum += _lpt(costs, n_prefill)
        bound_sum += max(sum(costs) / n_prefill, max(costs))
    d_policy = sum(s[0] for s in decode_samples)
    d_opt = sum(s[1] for s in decode_samples)
    d_ratio = [s[0] / s[2] for s in decode_samples if s[2] > 0]
    return {
        "requests": len(jobs),
        "span_s": span,
        "ttft_s": _percentiles([j.ttft_s for j in jobs]),
        "tbt_s": _percentiles([s[0] for s in steps], [s[1] for s in steps]),
        "goodput_rps": len(good) / span,
        "slo_attainment": len(good) / len(jobs),
        "prefill_balance": {"vs_lpt": lpt_sum / policy_sum, "vs_lower_bound": bound_sum / policy_sum},
        "decode_balance": {
            "vs_lpt": d_opt / d_policy if d_policy else 1.0,
            "max_over_mean": sum(d_ratio) / len(d_ratio) if d_ratio else 1.0,
        },
        "cached_token_ratio": sum(j.cached for j in jobs) / sum(j.input_tokens for j in jobs),
    }
