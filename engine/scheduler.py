"""Continuous batching: every request an engine holds advances together, one forward a step.

A step, in order (vLLM's scheduler; nano-vllm's ``scheduler.py``), over the requests that may step (the worker
loop admits a waiting request, preempted ones first, once the pages of its whole prompt are free):

1. **Decode**: every request past its prompt computes one token. One whose next position starts a page gets a
   page; when none is free, the running request admitted last is **preempted** (its pages given back, the
   request queued first in line) until one is; if that is the request itself, it waits in line. An answer that
   could not grow even with the whole cache ends there (``"length"``).
2. **Prefill**: requests computing their prompt, least prompt left first. With a cost model each gets the largest
   chunk that ``t(q, c)`` fits in what is left of the step's budget after the decode tokens' ``d(n, kv)`` (the
   first chunk of a step at least one runner chunk, so prefill always progresses); without one a prompt is
   computed whole.
3. **Forward**: one :meth:`Runner.forward` over every request's piece; each request takes its logits (a token,
   the end of a prefill piece, or the end of its answer).

A request holds pages for what it has computed and the prompt it is computing, never for tokens it may generate:
its prompt's pages when it is admitted, then one page each ``block_tokens`` decoded tokens.

**Preemption: refetch or recompute.** A preempted request resumes as a prefill of every token it had, whose last
logits choose its next token, so its answer goes on as if it had never stopped. It either fetches the blocks the
store holds of its tokens (those it found, and every full block it computed: published as it is preempted) and
computes only the rest, or recomputes everything. Refetch when the cost model says it is cheaper:
``fetch(bytes) + t(n − h, h) < t(n, 0)``, with ``fetch`` at the rate this engine's own fetches ran so far (the first
refetch, before any fetch, measures it); always without a cost model, never without a store or when the request
is not exact (a bounded replay) or stores nothing of its own and found nothing. A resume never replays: a hit
without its StateBlock is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.engine.engine import Engine, Generation


class StepCost(Protocol):
    """The step cost model (``kvtier.serving.cost.CostModel``): seconds of a prefill chunk and of a decode step."""

    def prefill_s(self, q: int, c: int) -> float: ...

    def decode_s(self, n: int, kv: int) -> float: ...

    def largest_chunk(self, left: int, c: int, time_left_s: float, granule: int = 1) -> int: ...


@dataclass
class Advanced:
    """What a step did for one request: the token it produced (None: a prefill piece that did not end its
    prompt), or the error that ended it (one line)."""

    key: Any
    generation: Generation
    token: int | None = None
    error: str | None = None


class Scheduler:
    """The steps of one engine's running requests (see the module doc); which requests run, and when a waiting
    one is admitted (its prompt's pages allocated), is its caller's (``worker.WorkerLoop``). Not thread-safe."""

    def __init__(self, engine: Engine, cost: StepCost | None = None, step_budget_s: float = 0.0) -> None:
        self.engine, self.cost, self.step_budget_s = engine, cost, step_budget_s
        self.preemptions = 0
        self.refetches = 0

    def step(self, running: dict[Any, Generation], on_preempt: Callable[[Any], None]) -> list[Advanced]:
        """One step of ``running`` (the requests that may step now, in the order they were admitted: the last is
        preempted first). A request preempted for pages is taken out of ``running`` and handed to ``on_preempt``
        (to queue it first in line); returns what the step did for each of the others that took part (a finished
        one has its ``finish_reason`` set; closing it is the caller's)."""
        running = dict(running)
        planned: dict[Any, int | None] = {}  # the requests of this forward, and the most prefill tokens each
        done: list[Advanced] = []
        for key in [k for k, g in running.items() if g.computed is not None and not g.prompt_left]:
            g = running.get(key)
            if g is not None and self._room(key, g, running, planned, on_preempt, done):
                planned[key] = None
        self._plan_prefill(running, planned)
        return done + self._forward(running, planned)

    def _plan_prefill(self, running: dict[Any, Generation], planned: dict[Any, int | None]) -> None:
        """A prefill piece for every prompt being computed, least left first, within the step's budget."""
        time_left = self.step_budget_s
        if self.cost is not None:
            decoding = [running[k] for k in planned]
            time_left -= self.cost.decode_s(len(decoding), sum(g.cached for g in decoding))
        first = True
        chunk = self.engine.runner.chunk_tokens
        prefilling = sorted(
            (k for k, g in running.items() if k not in planned and (g.computed is None or g.prompt_left)),
            key=lambda k: running[k].prompt_left,
        )
        for key in prefilling:
            g = running[key]
            limit = None
            if self.cost is not None:
                limit = self.cost.largest_chunk(g.prompt_left, g.cached, time_left, chunk)
                if limit <= 0:
                    if not first:
                        return
                    limit = chunk
                time_left -= self.cost.prefill_s(limit, g.cached)
            planned[key] = limit
            first = False

    def _room(
        self,
        key: Any,
        g: Generation,
        running: dict[Any, Generation],
        planned: dict[Any, int | None],
        on_preempt: Callable[[Any], None],
        done: list[Advanced],
    ) -> bool:
        """A page for the next position of ``g`` if it needs one, preempting the requests admitted last while none
        is free; False when it does not step now (it was preempted itself, the pages it needs are still held by
        store calls, or its answer cannot grow in this cache even alone: then it ends with ``"length"``)."""
        runner, cache = self.engine.runner, self.engine.cache
        length = g.cached + 1
        if -(-length // cache.block_tokens) > cache.num_pages:
            g.stop_for_length()
            done.append(Advanced(key, g))
            del running[key]
            return False
        while runner.pages_short(g.seq, length) > cache.free_pages:
            victim = next((k for k in reversed(running) if not running[k].holding), None)
            if victim is None:
                return False  # every candidate's pages are in use by store calls: next step
            self._preempt(victim, running.pop(victim), on_preempt)
            planned.pop(victim, None)
            if victim == key:
                return False
        runner.ensure_pages(g.seq, length)
        return True

    def _preempt(self, key: Any, g: Generation, on_preempt: Callable[[Any], None]) -> None:
        refetch = self.refetch_pays(g)
        g.preempt(refetch)
        self.preemptions += 1
        self.refetches += refetch
        on_preempt(key)

    def refetch_pays(self, g: Generation) -> bool:
        """Whether ``g``, preempted now, would resume from the store's blocks rather than recompute them (the
        module doc's rule)."""
        engine = self.engine
        blocks = g.restorable_blocks
        if engine.store is None or not g.reuse or g.seq.replayed or not blocks:
            return False
        if self.cost is None or not engine.fetch_s:
            return True
        n, hit = g.cached + 1, blocks * engine.block_tokens
        fetch_s = blocks * engine.block_bytes * engine.fetch_s / engine.fetched_bytes
        return fetch_s + self.cost.prefill_s(n - hit, hit) < self.cost.prefill_s(n, 0)

    def _forward(self, running: dict[Any, Generation], planned: dict[Any, int | None]) -> list[Advanced]:
        """One forward over the planned requests' pieces; each takes its logits."""
        out: list[Advanced] = []
        works, keys = [], []
        for key, limit in planned.items():
            try:
                works.append(running[key].work(limit))
                keys.append(key)
            except Exception as e:  # a bug or a device failure: this request fails, the others go on
                out.append(_failed(key, running[key], e))
        try:
            logits = self.engine.runner.forward(works) if works else []
        except Exception as e:  # the whole forward failed: every request in it
            return out + [_failed(key, running[key], e) for key in keys]
        for key, row in zip(keys, logits, strict=True):
            try:
                out.append(Advanced(key, running[key], running[key].take(row)))
            except Exception as e:
                out.append(_failed(key, running[key], e))
        return out


def _failed(key: Any, g: Generation, error: Exception) -> Advanced:
    return Advanced(key, g, error=f"{type(error).__name__}: {error}")
