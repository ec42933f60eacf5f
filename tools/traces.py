"""Request traces for replay: the Mooncake (FAST'25) JSONL format, a reader and writer, and seeded generators.

One request per line: ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [ints]}``, plus an
optional ``"ttl_class"`` (absent means :data:`DEFAULT_TTL_CLASS`). Each hash id names one ``block_tokens``-token
prefix block; equal ids are the same (reusable) block.

Generators are deterministic: the same arguments and seed give the same trace, byte for byte, on any machine
(they use their own ``random.Random``). Timestamps are integer milliseconds, strictly increasing.

- :func:`multi_turn_trace`: conversations; each turn's ``hash_ids`` extend the previous turn's (the context grows by
  the previous answer and the new user message). Lengths are whole blocks so the extension is exact.
- :func:`shared_prefix_trace`: single-shot requests that start with one of a few system prompts (Zipf popularity)
  followed by a unique user part whose last block may be partial.
- :func:`mixed_trace`: both at once; conversations also open with a shared system prompt, and a share of them are
  ``agent`` traffic (``ttl_class: "agent"``).
- :func:`chat_trace`, :func:`agent_trace`, :func:`long_document_trace` and :func:`serving_mix_trace` (all three):
  the shapes of serving traffic for ``kvbench route``, with bursty arrivals (:func:`bursty_times`) and long
  shared prefixes.

``python -m kvtier.tools.traces mixed 100000 trace.jsonl --seed 1`` writes one.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TTL_CLASS = "chatbot"
DEFAULT_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that is not a valid request; the message starts with ``PATH:LINE:`` when read from a file."""


@dataclass(slots=True)
class Request:
    """One trace line. ``timestamp`` is in milliseconds; ``ttl_class`` None means :data:`DEFAULT_TTL_CLASS`."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)
    ttl_class: str | None = None

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Request:
        """Validate one decoded line. Raises TraceError naming the bad field; unknown fields are ignored."""
        if not isinstance(obj, Mapping):
            raise TraceError(f"expected a JSON object, got {type(obj).__name__}")
        for name in ("timestamp", "input_length", "hash_ids"):
            if name not in obj:
                raise TraceError(f"missing field {name!r}")
        timestamp = obj["timestamp"]
        if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not math.isfinite(timestamp):
            raise TraceError(f"'timestamp' must be a number of milliseconds, got {timestamp!r}")
        input_length = _non_negative_int(obj, "input_length")
        output_length = _non_negative_int(obj, "output_length") if "output_length" in obj else 0
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids):
            raise TraceError("'hash_ids' must be a list of integers")
        ttl_class = obj.get("ttl_class")
        if ttl_class is not None and (not isinstance(ttl_class, str) or not ttl_class):
            raise TraceError(f"'ttl_class' must be a non-empty string, got {ttl_class!r}")
        return cls(timestamp, input_length, output_length, hash_ids, ttl_class)

    def to_dict(self) -> dict[str, Any]:
        """The JSONL object; ``ttl_class`` only when set."""
        out: dict[str, Any] = {
            "timestamp": self.timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
        }
        if self.ttl_class is not None:
            out["ttl_class"] = self.ttl_class
        return out


def _non_negative_int(obj: Mapping[str, Any], name: str) -> int:
    value = obj[name]
    if type(value) is not int or value < 0:
        raise TraceError(f"{name!r} must be a non-negative integer, got {value!r}")
    return value


def read_trace(path: str | Path) -> Iterator[Request]:
    """Requests from a JSONL file, lazily, in file order; blank lines are skipped.

    Raises OSError (e.g. FileNotFoundError) if the file cannot be opened, and TraceError ``"PATH:LINE: why"`` at the
    first line that is not valid JSON or not a valid request.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            try:
                yield Request.from_dict(obj)
            except TraceError as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None


def load_trace(path: str | Path) -> list[Request]:
    """All of :func:`read_trace` as a list (same errors)."""
    return list(read_trace(path))


def write_trace(path: str | Path, requests: Iterable[Request]) -> int:
    """Write requests as JSONL (compact, one per line); returns how many were written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request.to_dict(), separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


# --- generators ---------------------------------------------------------------------------------------------------

_Event = tuple[float, int, Request]  # (time in ms, tie-break sequence, request) before timestamps are finalised


@dataclass
class _Source:
    """State shared by the streams of one generated trace: its random stream, hash-id allocator, event order."""

    rng: random.Random
    block_tokens: int
    ids: Iterator[int] = field(default_factory=itertools.count)
    seq: Iterator[int] = field(default_factory=itertools.count)

    def fresh(self, n: int) -> list[int]:
        """``n`` hash ids never used before in this trace."""
        return [next(self.ids) for _ in range(n)]

    def system_prompts(self, n_prompts: int, prompt_blocks: tuple[int, int]) -> list[list[int]]:
        return [self.fresh(self.rng.randint(*prompt_blocks)) for _ in range(n_prompts)]

    def zipf_picker(self, n: int, s: float) -> Callable[[], int]:
        """Index 0..n-1 with probability ∝ 1/(i+1)^s: a few system prompts are very popular, most are rare."""
        cumulative = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))
        return lambda: self.rng.choices(range(n), cum_weights=cumulative)[0]


def _single_shot_events(
    src: _Source,
    n_requests: int,
    *,
    prefix: Callable[[], list[int]],
    user_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    rate_per_s: float,
) -> list[_Event]:
    """Poisson arrivals of ``prefix()`` blocks followed by a unique user part (its last block may be partial)."""
    rng, bt = src.rng, src.block_tokens
    events: list[_Event] = []
    t = 0.0
    for _ in range(n_requests):
        t += rng.expovariate(rate_per_s) * 1000.0
        shared = prefix()
        user = rng.randint(*user_tokens)
        ids = shared + src.fresh(-(-user // bt))
        events.append((t, next(src.seq), Request(0, len(shared) * bt + user, rng.randint(*output_tokens), ids)))
    return events


def _conversation_events(
    src: _Source,
    n_requests: int,
    *,
    opening: Callable[[], list[int]],
    turns: tuple[int, int],
    user_blocks: tuple[int, int],
    output_blocks: tuple[int, int],
    think_s: tuple[float, float],
    rate_per_s: float,
    agent_share: float,
) -> list[_Event]:
    """Conversations until ``n_requests`` turns exist (the last one cut short); each turn extends the previous."""
    rng, bt = src.rng, src.block_tokens
    events: list[_Event] = []
    conversation_rate = rate_per_s / ((turns[0] + turns[1]) / 2)
    start = 0.0
    while len(events) < n_requests:
        start += rng.expovariate(conversation_rate) * 1000.0
        ttl_class = "agent" if rng.random() < agent_share else None
        context = opening()
        t = start
        for turn in range(rng.randint(*turns)):
            if len(events) == n_requests:
                break
            if turn:
                t += rng.uniform(*think_s) * 1000.0
            context = context + src.fresh(rng.randint(*user_blocks))
            answer_blocks = rng.randint(*output_blocks)
            request = Request(0, len(context) * bt, answer_blocks * bt, context, ttl_class)
            events.append((t, next(src.seq), request))
            # The answer is context of the next turn, so that turn's prefill is what stores its blocks.
            context = context + src.fresh(answer_blocks)
    return events


def _finish(*streams: list[_Event]) -> list[Request]:
    """Merge event streams by time and give every request an integer-millisecond, strictly increasing timestamp."""
    out: list[Request] = []
    last = -1
    for t, _, request in heapq.merge(*(sorted(s, key=lambda e: (e[0], e[1])) for s in streams)):
        last = max(int(t), last + 1)
        request.timestamp = last
        out.append(request)
    return out


def multi_turn_trace(
    n_requests: int,
    *,
    seed: int = 0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    turns: tuple[int, int] = (2, 8),
    first_blocks: tuple[int, int] = (4, 24),
    user_blocks: tuple[int, int] = (1, 3),
    output_blocks: tuple[int, int] = (1, 2),
    think_s: tuple[float, float] = (5.0, 120.0),
    rate_per_s: float = 20.0,
    ttl_class: str | None = None,
) -> list[Request]:
    """``n_requests`` turns of multi-turn conversations, interleaved in time.

    A conversation has ``turns`` turns (inclusive range); its first request has ``first_blocks`` fresh blocks; every
    later turn's ``hash_ids`` are the previous turn's, then the previous answer's ``output_blocks`` blocks, then the
    new user message's ``user_blocks`` blocks. ``input_length == len(hash_ids) × block_tokens``. Conversations start
    as a Poisson process sized so requests arrive at about ``rate_per_s``; turns are ``think_s`` seconds apart.
    Every request gets ``ttl_class`` (None: the default class).
    """
    src = _Source(random.Random(seed), block_tokens)
    events = _conversation_events(
        src,
        n_requests,
        opening=lambda: src.fresh(src.rng.randint(*first_blocks)),
        turns=turns,
        user_blocks=user_blocks,
        output_blocks=output_blocks,
        think_s=think_s,
        rate_per_s=rate_per_s,
        agent_share=0.0,
    )
    trace = _finish(events)
    for request in trace:
        request.ttl_class = ttl_class
    return trace


def shared_prefix_trace(
    n_requests: int,
    *,
    seed: int = 0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    n_prompts: int = 16,
    prompt_blocks: tuple[int, int] = (4, 24),
    zipf_s: float = 1.2,
    user_tokens: tuple[int, int] = (64, 4096),
    output_tokens: tuple[int, int] = (16, 1024),
    rate_per_s: float = 20.0,
) -> list[Request]:
    """``n_requests`` single-shot requests sharing ``n_prompts`` system prompts as their leading blocks.

    Prompt ``i`` is chosen with probability ∝ ``1/(i+1)^zipf_s``; it is followed by a unique user part of
    ``user_tokens`` tokens (fresh ids; the last block may be partial, so
    ``input_length == len(prompt) × block_tokens + user tokens``). Poisson arrivals at ``rate_per_s``.
    """
    src = _Source(random.Random(seed), block_tokens)
    prompts = src.system_prompts(n_prompts, prompt_blocks)
    pick = src.zipf_picker(n_prompts, zipf_s)
    events = _single_shot_events(
        src,
        n_requests,
        prefix=lambda: prompts[pick()],
        user_tokens=user_tokens,
        output_tokens=output_tokens,
        rate_per_s=rate_per_s,
    )
    return _finish(events)


def mixed_trace(
    n_requests: int,
    *,
    seed: int = 0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    conversation_share: float = 0.5,
    agent_share: float = 0.25,
    n_prompts: int = 16,
    prompt_blocks: tuple[int, int] = (4, 24),
    zipf_s: float = 1.2,
    rate_per_s: float = 20.0,
) -> list[Request]:
    """``n_requests`` requests: ``conversation_share`` of them multi-turn conversation turns, the rest single-shot.

    Both kinds open with one of the same ``n_prompts`` shared system prompts (Zipf popularity), so prefixes are
    reused across conversations and single-shot requests; a conversation's first turn adds 1–4 blocks of its own.
    Other shapes are :func:`multi_turn_trace`'s and :func:`shared_prefix_trace`'s defaults. ``agent_share`` of the
    conversations carry ``ttl_class: "agent"``; everything else has no class (the default, ``chatbot``). The two
    streams arrive at rates proportional to their shares over the same time span, ``rate_per_s`` in total.
    About 20 blocks per request with the defaults.
    """
    if not 0.0 <= conversation_share <= 1.0:
        raise ValueError(f"conversation_share must be in [0, 1], got {conversation_share}")
    src = _Source(random.Random(seed), block_tokens)
    prompts = src.system_prompts(n_prompts, prompt_blocks)
    pick = src.zipf_picker(n_prompts, zipf_s)
    n_conversation = round(n_requests * conversation_share)
    conversations = _conversation_events(
        src,
        n_conversation,
        opening=lambda: prompts[pick()] + src.fresh(src.rng.randint(1, 4)),
        turns=(2, 8),
        user_blocks=(1, 3),
        output_blocks=(1, 2),
        think_s=(5.0, 120.0),
        rate_per_s=rate_per_s * conversation_share,
        agent_share=agent_share,
    )
    single = _single_shot_events(
        src,
        n_requests - n_conversation,
        prefix=lambda: prompts[pick()],
        user_tokens=(64, 4096),
        output_tokens=(16, 1024),
        rate_per_s=rate_per_s * (1.0 - conversation_share) or 1.0,
    )
    return _finish(conversations, single)


# --- serving traces: bursty arrivals, the shapes of chat, agent and long-document traffic ------------------------


def bursty_times(rng: random.Random, n: int, rate_per_s: float, burst_factor: float = 6.0,
                 burst_share: float = 0.3, mean_burst_s: float = 4.0) -> list[float]:  # fmt: skip
    """``n`` arrival times (ms) of a two-state Markov-modulated Poisson process averaging ``rate_per_s``: a
    ``burst_share`` of the time arrivals come ``burst_factor`` times faster than in the calm state; bursts last
    ``mean_burst_s`` on average (exponential), calm spells correspondingly longer."""
    calm = rate_per_s / (1 - burst_share + burst_share * burst_factor)
    mean_calm_s = mean_burst_s * (1 - burst_share) / burst_share
    times: list[float] = []
    t, bursting = 0.0, False
    switch = rng.expovariate(1 / mean_calm_s)
    while len(times) < n:
        rate = calm * burst_factor if bursting else calm
        gap = rng.expovariate(rate)
        if t + gap > switch:
            t, bursting = switch, not bursting
            switch = t + rng.expovariate(1 / (mean_burst_s if bursting else mean_calm_s))
            continue
        t += gap
        times.append(t * 1000.0)
    return times


def _sessions(
    src: _Source,
    n_requests: int,
    starts: list[float],
    opening: Callable[[], list[int]],
    turns: tuple[int, int],
    added_blocks: tuple[int, int],
    output_tokens: tuple[int, int],
    gap_s: tuple[float, float],
    ttl_class: str | None,
) -> list[_Event]:
    """Sessions starting at ``starts`` (ms); each turn's context is the previous one's plus the previous answer's
    blocks plus ``added_blocks`` new ones (a user message, a tool result), until ``n_requests`` turns exist."""
    rng, bt = src.rng, src.block_tokens
    events: list[_Event] = []
    for start in starts:
        if len(events) >= n_requests:
            break
        context, t = opening(), start
        for turn in range(rng.randint(*turns)):
            if len(events) >= n_requests:
                break
            if turn:
                t += rng.uniform(*gap_s) * 1000.0
            context = context + src.fresh(rng.randint(*added_blocks))
            out = rng.randint(*output_tokens)
            events.append((t, next(src.seq), Request(0, len(context) * bt, out, context, ttl_class)))
            context = context + src.fresh(-(-out // bt))
    return events


def chat_trace(n_requests: int, *, seed: int = 0, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               rate_per_s: float = 4.0) -> list[Request]:  # fmt: skip
    """Chat: conversations of 2–8 turns opening with one of 16 shared system prompts (1–4 blocks, Zipf) plus 1–4
    blocks of their own; each turn adds a 1–3 block message; answers of 64–768 tokens; users think 5–60 s.
    Conversations start in bursts (:func:`bursty_times`). Contexts stay mostly under 16K tokens."""
    src = _Source(random.Random(seed), block_tokens)
    prompts = src.system_prompts(16, (1, 4))
    pick = src.zipf_picker(16, 1.2)
    starts = bursty_times(src.rng, n_requests, rate_per_s / 5)
    opening = lambda: prompts[pick()] + src.fresh(src.rng.randint(1, 4))  # noqa: E731
    return _finish(_sessions(src, n_requests, starts, opening, (2, 8), (1, 3), (64, 768), (5.0, 60.0), None))


def agent_trace(n_requests: int, *, seed: int = 0, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                rate_per_s: float = 4.0) -> list[Request]:  # fmt: skip
    """Agents: sessions of 4–24 steps opening with one of 6 long shared prefixes (tool definitions and a code base,
    16–64 blocks = 8–32K tokens, Zipf) plus a 1–8 block task; each step adds a 1–6 block tool result and answers
    with 32–384 tokens (a tool call), 1–10 s apart. Contexts grow from ~10K to over 64K tokens. Class ``agent``."""
    src = _Source(random.Random(seed), block_tokens)
    prefixes = src.system_prompts(6, (16, 64))
    pick = src.zipf_picker(6, 1.0)
    starts = bursty_times(src.rng, n_requests, rate_per_s / 14)
    opening = lambda: prefixes[pick()] + src.fresh(src.rng.randint(1, 8))  # noqa: E731
    return _finish(_sessions(src, n_requests, starts, opening, (4, 24), (1, 6), (32, 384), (1.0, 10.0), "agent"))


def long_document_trace(n_requests: int, *, seed: int = 0, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                        rate_per_s: float = 1.0) -> list[Request]:  # fmt: skip
    """Long documents: single questions about one of 40 documents of 24K–400K tokens (Zipf popularity, so popular
    documents are asked about again and their prefix is reused) followed by a 64–1,024 token question; answers of
    128–1,024 tokens; bursty arrivals."""
    src = _Source(random.Random(seed), block_tokens)
    documents = src.system_prompts(40, (48, 800))
    pick = src.zipf_picker(40, 0.9)
    events = []
    for t in bursty_times(src.rng, n_requests, rate_per_s):
        doc = documents[pick()]
        question = src.rng.randint(64, 1024)
        ids = doc + src.fresh(-(-question // block_tokens))
        output = src.rng.randint(128, 1024)
        events.append((t, next(src.seq), Request(0, len(doc) * block_tokens + question, output, ids)))
    return _finish(events)


def serving_mix_trace(n_requests: int, *, seed: int = 0, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                      rate_per_s: float = 6.0) -> list[Request]:  # fmt: skip
    """Chat, agent and long-document traffic at once (60 / 30 / 10 % of the requests), in the same time span."""
    shares = {chat_trace: 0.6, agent_trace: 0.3, long_document_trace: 0.1}
    parts = []
    offset = 0
    for i, (make, share) in enumerate(shares.items()):
        part = make(round(n_requests * share), seed=seed * 3 + i, block_tokens=block_tokens,
                    rate_per_s=rate_per_s * share)  # fmt: skip
        for r in part:  # each generator numbers its blocks from 0: keep them apart
            r.hash_ids = [h + offset for h in r.hash_ids]
        offset = 1 + max((h for r in part for h in r.hash_ids), default=offset - 1)
        parts.append([(float(r.timestamp), j, r) for j, r in enumerate(part)])
    return _finish(*parts)


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "multi-turn": multi_turn_trace,
    "shared-prefix": shared_prefix_trace,
    "mixed": mixed_trace,
    "chat": chat_trace,
    "agent": agent_trace,
    "long-document": long_document_trace,
    "serving-mix": serving_mix_trace,
}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvtier.tools.traces KIND N OUT [--seed S] [--block-tokens B] [--rate R]``: write a trace."""
    parser = argparse.ArgumentParser(prog="traces", description="Write a seeded synthetic trace (Mooncake JSONL).")
    parser.add_argument("kind", choices=sorted(GENERATORS))
    parser.add_argument("requests", type=int, help="number of requests")
    parser.add_argument("out", help="output .jsonl path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    parser.add_argument("--rate", type=float, help="mean arrivals per second (default: the generator's)")
    args = parser.parse_args(argv)
    if args.requests < 0 or args.block_tokens <= 0 or (args.rate is not None and args.rate <= 0):
        print("traces: requests must be >= 0, --block-tokens and --rate > 0", file=sys.stderr)
        return 2
    rate = {} if args.rate is None else {"rate_per_s": args.rate}
    trace = GENERATORS[args.kind](args.requests, seed=args.seed, block_tokens=args.block_tokens, **rate)
    try:
        n = write_trace(args.out, trace)
    except OSError as exc:
        print(f"traces: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    blocks = sum(len(r.hash_ids) for r in trace)
    print(f"wrote {n} requests ({blocks / max(n, 1):.1f} blocks/request) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
