"""The prefill balancer: requests by total context length into buckets, prefill engines to buckets in proportion
to each bucket's compute demand over the previous window, and within a bucket the engine with the least
predicted work ahead of the request. Routing ignores cache affinity: the cache is the cluster's, so any engine hits any
prefix, and a request's cost is known before it is placed (``t(q, c)`` with ``c`` its hit).

Every decision is a function of named quantities with the time passed in (``now``), so the server and
``kvbench route``'s simulation run the same code.

Worked example (docs/serving.md has it in full): edges 16K/64K/256K, 4 engines, previous window's demand
(seconds of ``t(q, c)``) = [6, 3, 3, 0] → shares 2, 1, 1, 0 engines: engines 0–1 take < 16K, engine 2 16–64K,
engine 3 64–256K; a ≥ 256K request (no demand last window) goes to the nearest bucket's, engine 3. With demand
[1, 5, 2, 0] the shares are 0.5, 2.5, 1 and 0: engine 0 serves < 16K and 16–64K, engines 1–2 16–64K, engine 3
64–256K (and ≥ 256K).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_EDGES = (16_384, 65_536, 262_144)


def bucket_of(context_tokens: int, edges: Sequence[int] = DEFAULT_EDGES) -> int:
    """The bucket of a request with ``context_tokens`` tokens in all: ``i`` where ``edges[i-1] <= n < edges[i]``."""
    return bisect.bisect_right(edges, context_tokens)


def assign_engines(demand: Sequence[float], engines: int) -> list[dict[int, float]]:
    """The engines of each bucket, in proportion to ``demand``, as ``{engine: share of it}``: the buckets laid
    in order along the engines' capacity, each taking a stretch as long as its share (``engines × demand /
    total``); a bucket's engines are those its stretch overlaps, each with the part of it the stretch covers (an
    engine on a boundary serves both neighbours, so no share is rounded away). A bucket without demand borrows
    the nearest bucket's engines (the longer one on a tie); no demand at all: every engine serves every bucket."""
    total = sum(demand)
    if total <= 0:
        return [dict.fromkeys(range(engines), 1.0) for _ in demand]
    own: list[dict[int, float]] = []
    start = 0.0
    for d in demand:
        end = start + engines * d / total
        share = {}
        if d > 0:
            for e in range(min(int(start), engines - 1), min(math.ceil(end), engines)):
                share[e] = min(end, e + 1) - max(start, e)
        own.append({e: f for e, f in share.items() if f > 1e-9} or ({engines - 1: 1.0} if d > 0 else {}))
        start = end
    return [own[nearest_served(b, own)] for b in range(len(own))]


def nearest_served(bucket: int, served: Sequence[dict[int, float]]) -> int:
    """The bucket whose engines take ``bucket``'s requests: itself if it has engines, else the nearest one that
    does (the longer one on a tie: its engines are sized for more work)."""
    for d in range(len(served)):
        for b in (bucket + d, bucket - d):
            if 0 <= b < len(served) and served[b]:
                return b
    raise ValueError("no engines")


@dataclass
class PrefillBalancer:
    """Which prefill engine takes a request. Demand is counted per ``window_s``; at each window's end the
    engines are re-assigned to buckets from the window just ended (the first window, and one after a window
    without arrivals, lets every engine serve every bucket). ``queued[e]`` holds the predicted seconds of each
    request engine ``e`` has not finished: :meth:`route` adds one, :meth:`done` takes it off.

    An engine computes the request with the least prompt left first (``WorkerLoop``), so the work ahead of a new
    request of cost ``x`` there is ``Σ min(queued, x)``. Among a bucket's engines the one with the least work
    ahead plus work given in this window (so light traffic still spreads evenly), over the share of it that is
    the bucket's, wins; unless its work ahead exceeds the least loaded engine's by more than ``spill_s``: a
    backed-up bucket spills the request there."""

    engines: int
    window_s: float = 10.0
    edges: Sequence[int] = DEFAULT_EDGES
    spill_s: float = 0.25  # seconds of extra work ahead before a bucket's request goes elsewhere
    window_start: float | None = None
    demand: list[float] = field(default_factory=list)
    served: list[dict[int, float]] = field(default_factory=list)  # per bucket: engine -> its share of it
    assigned: list[float] = field(default_factory=list)  # seconds routed to each engine in this window
    queued: list[list[float]] = field(default_factory=list)  # each engine's unfinished requests' costs

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("a prefill balancer needs at least one engine")
        self.demand = [0.0] * (len(self.edges) + 1)
        self.served = assign_engines(self.demand, self.engines)
        self.queued = [[] for _ in range(self.engines)]
        self.assigned = [0.0] * self.engines

    def route(self, context_tokens: int, cost_s: float, now: float, up: Sequence[bool] | None = None) -> int:
        """The engine for a request of ``context_tokens`` tokens predicted to take ``cost_s`` seconds of
        prefill, arriving at ``now`` (seconds, any monotonic origin). ``up[e]`` False leaves engine ``e`` out
        (a worker restarting); a bucket none of whose engines is up uses the least loaded one that is."""
        self._roll(now)
        bucket = bucket_of(context_tokens, self.edges)
        self.demand[bucket] += cost_s
        alive = [e for e in range(self.engines) if up is None or up[e]] or list(range(self.engines))
        share = {e: f for e, f in self.served[bucket].items() if e in alive} or dict.fromkeys(alive, 1.0)
        ahead = [sum(min(c, cost_s) for c in self.queued[e]) for e in range(self.engines)]
        engine = min(share, key=lambda e: ((ahead[e] + self.assigned[e]) / share[e], e))
        spare = min(alive, key=lambda e: (ahead[e] + self.assigned[e], e))
        if ahead[engine] - ahead[spare] > self.spill_s:  # the bucket is backed up: spill
            engine = spare
        self.queued[engine].append(cost_s)
        self.assigned[engine] += cost_s
        return engine

    def done(self, engine: int, cost_s: float) -> None:
        """Engine ``engine`` finished (or dropped) a request routed with ``cost_s``."""
        if cost_s in self.queued[engine]:
            self.queued[engine].remove(cost_s)

    def _roll(self, now: float) -> None:
        if self.window_start is None:
            self.window_start = now
        if now - self.window_start >= self.window_s:
            ended = now - self.window_start < 2 * self.window_s  # a window with no arrivals after it: no demand
            self.served = assign_engines(self.demand if ended else [0.0] * len(self.demand), self.engines)
            self.demand = [0.0] * len(self.demand)
            self.assigned = [0.0] * self.engines
            self.window_start = now - (now - self.window_start) % self.window_s
