"""The server object behind the routes: validates a request into :class:`Job` s (one per choice), admits them or
refuses them (429), routes them to the workers through the balancers, and turns the tokens that come back into
OpenAI responses or server-sent events (async generators). It holds no KV and imports no model code: it talks to
workers.

One request, in order:

1. read (the app: at most ``--max-request-bytes``, else 413) and **prepare**, on a thread of :attr:`Server.pool`,
   never on the event loop: decode the JSON, validate (400: malformed or too deeply nested JSON, a field of the
   wrong type, an empty prompt, a text longer than the context could hold (before any tokenization), a prompt
   that leaves no room in the context, ``max_tokens`` < 1 or past the context, token ids outside the vocabulary,
   sampling settings out of range, fields this server does not implement), render the chat template and
   tokenize; 404 for an unknown model;
2. admit: 400 for what could never be admitted (more prompt tokens than ``--max-queued-tokens``, more choices
   than ``--max-queued-requests``, more KV than a worker's cache holds); 503 while a pool has no worker up; past
   ``max_queued_requests`` or ``max_queued_tokens`` of requests still waiting for their first token, 429 with
   ``Retry-After`` (the queued prefill work over the prefill engines, predicted by the cost model, at least 1 s),
   before any response starts;
3. P/D: the prefill balancer picks a prefill worker, which reuses what the store holds, computes the rest, stores
   it and chooses the first token; the decode balancer picks a decode worker, which resumes from the store and
   streams the other tokens. Embedded: the one engine does both. Each of ``n`` choices is its own request, with
   its own seed (the request's for the first);
4. tokens → text deltas (stop strings end the answer with ``finish_reason: "stop"``, and the request is aborted
   on its worker); usage with ``prompt_tokens_details.cached_tokens`` = the prompt tokens reused from the store.

An error after a stream began is sent as an SSE error event; a client that goes away, a stop string, any error or
the end of the shutdown grace closes the token generators, which aborts the requests on their workers.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvtier.serving import protocol as p
from kvtier.serving.cost import CostModel
from kvtier.serving.decode_balance import pick_decode
from kvtier.serving.metrics import Metrics
from kvtier.serving.prefill_balance import DEFAULT_EDGES, PrefillBalancer
from kvtier.serving.text import Detokenizer, TemplateError, TextCodec
from kvtier.serving.workers import Worker

log = logging.getLogger("kvtier.serving")
TOKEN_PROXY = CostModel(0.0, 1e-4, 0.0)  # without a fitted model: cost ∝ new tokens (0.1 ms each)
MAX_CHOICES = 16
MAX_LOGPROBS = 20
SEED_STEP = 0x9E3779B97F4A7C15  # choice i samples with seed + i·SEED_STEP (odd: distinct seeds for every i)


@dataclass(frozen=True)
class Limits:
    max_queued_requests: int = 256
    max_queued_tokens: int = 1 << 20
    cache_tokens: int | None = None  # KV one worker's cache holds (--cache-tokens): a request needing more is a 400


@dataclass
class Job:
    """One choice of an admitted request and what became of it."""

    prompt: list[int]
    max_tokens: int
    sampling: dict[str, Any]  # the worker protocol's sampling fields
    stops: list[str]
    arrival: float
    index: int = 0  # the choice's place in ``choices``
    queued: bool = False
    hit_tokens: int = 0
    replayed: bool = False
    store_timeout: bool = False
    finish_reason: str | None = None
    generated: list[int] = field(default_factory=list)
    text_offset: int = 0  # characters of the answer's tokens whose logprobs were given out
    first_at: float | None = None

    @property
    def min_tokens(self) -> int:
        return int(self.sampling.get("min_tokens", 0))


@dataclass
class Delta:
    """New text of one choice and the logprobs of the tokens that made it (when asked)."""

    text: str
    logprobs: list[tuple[int, float, list[list[Any]]]]  # (token, logprob, [[id, logprob], …])


@dataclass
class Answer:
    """What a generating endpoint gives the app: its jobs (for the access log), and the whole JSON object or the
    SSE stream."""

    jobs: list[Job]
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None


class WorkerError(Exception):
    """A worker failed a request (it exited, or answered an error)."""


class ShuttingDown(Exception):
    """The shutdown grace ended before the answer did."""


class Server:
    """Serves one model from its ``prefill`` and ``decode`` workers (P/D), or from ``both`` (embedded)."""

    def __init__(
        self,
        codec: TextCodec,
        model: str | Sequence[str],
        context_tokens: int,
        vocab_size: int,
        *,
        prefill: Sequence[Worker] = (),
        decode: Sequence[Worker] = (),
        both: Sequence[Worker] = (),
        cost: CostModel | None = None,
        limits: Limits = Limits(),
        window_s: float = 10.0,
        edges: tuple[int, ...] = DEFAULT_EDGES,
        tbt_slo_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        prepare_threads: int = 4,
    ) -> None:
        if bool(prefill) != bool(decode) or bool(prefill) == bool(both):
            raise ValueError("give prefill and decode workers, or embedded ones, not both kinds")
        self.names = [model] if isinstance(model, str) else list(model)
        self.model = self.names[0]
        self.codec, self.context_tokens, self.vocab_size = codec, context_tokens, vocab_size
        self.prefill, self.decode, self.both = list(prefill), list(decode), list(both)
        self.cost = cost or TOKEN_PROXY
        self.tbt_slo_s = tbt_slo_s  # the decode balancer's rule 3 (serving.decode_balance)
        self.limits, self.clock = limits, clock
        self.balancer = PrefillBalancer(max(1, len(self.prefill)), window_s, edges)
        self.metrics = Metrics()
        self.queued_requests = 0
        self.queued_tokens = 0
        # decoding, validation, chat templates and tokenization: never on the event loop (a 50 MB prompt froze it)
        self.pool = concurrent.futures.ThreadPoolExecutor(prepare_threads, thread_name_prefix="kvtier-prepare")
        self.closing = False  # shutting down: no new requests
        self.cut: asyncio.Event | None = None  # set when the shutdown grace ends: answers still running are cut
        self._announced = False

    # -- lifecycle -------------------------------------------------------------------------------------

    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode, *self.both]

    async def start(self) -> None:
        self.cut = asyncio.Event()
        for w in self.workers():
            w.on_ready = self._worker_ready
            await w.start()

    def _worker_ready(self) -> None:
        """On the loop, whenever a worker says it is ready: the first time every worker is, one ``ready`` line."""
        ok, line = self.ready()
        if ok and not self._announced:
            self._announced = True
            print(f"kvtier-engine: ready ({line})", flush=True)

    def begin_shutdown(self, grace_s: float) -> None:
        """Take no new requests; answers still running ``grace_s`` from now are cut (an error event and
        ``[DONE]`` for a stream, a 503 for a whole answer)."""
        self.closing = True
        if self.cut is not None:
            asyncio.get_running_loop().call_later(grace_s, self.cut.set)

    def stop(self) -> None:
        """Stop every worker, all at once (each may take its time to exit)."""
        stops = [threading.Thread(target=w.stop) for w in self.workers()]
        for t in stops:
            t.start()
        for t in stops:
            t.join()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def pools(self) -> dict[str, list[Worker]]:
        return {"prefill": self.prefill, "decode": self.decode} if self.prefill else {"engine": self.both}

    def ready(self) -> tuple[bool, str]:
        """Whether every worker is up (``GET /health``), and a line saying how many of each pool are."""
        pools = self.pools()
        up = {name: sum(w.ready for w in ws) for name, ws in pools.items()}
        ok = all(up[name] == len(ws) for name, ws in pools.items())
        return ok, ", ".join(f"{name} {up[name]}/{len(ws)} up" for name, ws in pools.items())

    def serving(self) -> bool:
        """Whether every pool has a worker up: requests are taken (503 otherwise)."""
        return all(any(w.ready for w in ws) for ws in self.pools().values())

    def collect_metrics(self) -> None:
        """Refresh the gauges that are read, not counted."""
        m = self.metrics
        for name, ws in (("prefill", self.prefill), ("decode", self.decode), ("engine", self.both)):
            if ws:
                m.queue_depth.labels(name).set(sum(len(w.running) for w in ws))
        m.queued.set(self.queued_requests)
        for w in self.workers():
            m.worker_restarts.labels(w.name).set(w.restarts)

    # -- endpoints -------------------------------------------------------------------------------------

    async def completion(self, body: bytes, request_id: str | None = None) -> Answer:
        """``POST /v1/completions``: a ``text_completion`` object, or its SSE stream."""
        arrival = self.clock()
        req, jobs = await self._prepare(self._completion_jobs, body, arrival)
        self._admit(jobs)
        rid = p.new_id("cmpl", request_id)
        logprobs = self._completion_logprobs if req.logprobs is not None else None
        if not req.stream:
            outs = await self._whole(jobs)
            choices = [p.completion_choice(j.index, t, j.finish_reason, logprobs and logprobs(j, d)) for j, (t, d)
                       in zip(jobs, outs, strict=True)]  # fmt: skip
            return Answer(jobs, p.completion(rid, self.model, choices, self._usage(jobs)))

        def chunk(j: Job, text: str, finish: str | None, lps: list[Any]) -> dict[str, Any]:
            choice = p.completion_choice(j.index, text, finish, logprobs and logprobs(j, lps))
            return p.completion(rid, self.model, [choice], None)

        usage = lambda: p.completion(rid, self.model, [], self._usage(jobs))  # noqa: E731
        return Answer(jobs, stream=self._stream(jobs, chunk, usage if _include_usage(req) else None))

    async def chat(self, body: bytes, request_id: str | None = None) -> Answer:
        """``POST /v1/chat/completions``: a ``chat.completion`` object, or its SSE stream."""
        arrival = self.clock()
        req, jobs = await self._prepare(self._chat_jobs, body, arrival)
        self._admit(jobs)
        rid = p.new_id("chatcmpl", request_id)
        logprobs = self._chat_logprobs if req.logprobs else None
        if not req.stream:
            outs = await self._whole(jobs)
            choices = [p.chat_choice(j.index, t, j.finish_reason, logprobs and logprobs(j, d)) for j, (t, d)
                       in zip(jobs, outs, strict=True)]  # fmt: skip
            return Answer(jobs, p.chat_completion(rid, self.model, choices, self._usage(jobs)))
        started: set[int] = set()

        def chunk(j: Job, text: str, finish: str | None, lps: list[Any]) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text} if text or finish is None else {}
            if j.index not in started:
                started.add(j.index)
                delta["role"] = "assistant"
            choice = p.chat_delta(j.index, delta, finish, logprobs and logprobs(j, lps))
            return p.chat_chunk(rid, self.model, [choice])

        usage = lambda: {**p.chat_chunk(rid, self.model, []), "usage": self._usage(jobs)}  # noqa: E731
        return Answer(jobs, stream=self._stream(jobs, chunk, usage if _include_usage(req) else None))

    def models(self) -> dict[str, Any]:
        cards = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvtier", "root": self.model,
             "max_model_len": self.context_tokens}
            for name in self.names
        ]  # fmt: skip
        return {"object": "list", "data": cards}

    async def tokenize(self, body: bytes) -> dict[str, Any]:
        """``POST /tokenize``: ``{"model"?, "prompt"}`` or ``{"model"?, "messages"}`` → ``{"tokens", "count",
        "max_model_len"}``."""
        return await self._in_pool(self._tokenize, body)

    def _tokenize(self, body: bytes) -> dict[str, Any]:
        req: p.TokenizeRequest = p.decode(body, p.TokenizeRequest)
        self._check_model(req.model)
        if req.messages is not None:
            ids = self._encode(self._render(req.messages, req.add_generation_prompt), "messages")
        elif req.prompt is not None:
            ids = self._encode(req.prompt, "prompt")
        else:
            raise p.RequestError(400, "give prompt (a string) or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.context_tokens}

    async def detokenize(self, body: bytes) -> dict[str, Any]:
        """``POST /detokenize``: ``{"model"?, "tokens": [ids]}`` → ``{"prompt": text}``."""
        return await self._in_pool(self._detokenize, body)

    def _detokenize(self, body: bytes) -> dict[str, Any]:
        req: p.DetokenizeRequest = p.decode(body, p.DetokenizeRequest)
        self._check_model(req.model)
        self._check_ids(req.tokens, "tokens")
        return {"prompt": self.codec.decode(req.tokens)}

    # -- preparing a request (on the pool's threads) ---------------------------------------------------

    async def _in_pool(self, work: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, work, *args)

    async def _prepare(
        self, work: Callable[[bytes, float], tuple[Any, list[Job]]], body: bytes, arrival: float
    ) -> tuple[Any, list[Job]]:
        if self.closing:
            raise p.RequestError(503, "the server is shutting down", retry_after_s=5)
        return await self._in_pool(work, body, arrival)

    def _completion_jobs(self, body: bytes, arrival: float) -> tuple[p.CompletionRequest, list[Job]]:
        try:  # token ids, the long prompts' form, decoded typed: a Python check of 77K ids' types cost 3 ms
            req: p.CompletionRequest = msgspec.json.decode(body, type=p.TokenIdsRequest)
        except (msgspec.DecodeError, RecursionError):
            req = p.decode(body, p.CompletionRequest)
        self._check_fields(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise p.RequestError(400, f"logprobs must be in 0…{MAX_LOGPROBS}, got {req.logprobs}", "logprobs")
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise p.RequestError(400, "one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if (
            not isinstance(req, p.TokenIdsRequest)
            and isinstance(prompt, list)
            and not all(type(t) is int for t in prompt)
        ):
            raise p.RequestError(
                400, "prompt must be a string, a list of token ids, or a list of one of either", "prompt"
            )
        ids = self._encode(prompt, "prompt") if isinstance(prompt, str) else prompt
        return req, self._jobs(req, ids, req.max_tokens, 16, req.logprobs, arrival)

    def _chat_jobs(self, body: bytes, arrival: float) -> tuple[p.ChatRequest, list[Job]]:
        req: p.ChatRequest = p.decode(body, p.ChatRequest)
        self._check_fields(req)
        top = req.top_logprobs
        if top is not None and (not req.logprobs or not 0 <= top <= MAX_LOGPROBS):
            raise p.RequestError(400, f"top_logprobs must be in 0…{MAX_LOGPROBS}, with logprobs true", "top_logprobs")
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        text = self._render(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        ids = self._encode(text, "messages")
        logprobs = (top or 0) if req.logprobs else None
        return req, self._jobs(req, ids, limit, None, logprobs, arrival, param)

    def _check_fields(self, req: p._Common) -> None:
        self._check_model(req.model)
        if (name := req.refused()) is not None:
            raise p.RequestError(400, f"{name} is not supported by this server", name)

    def _render(
        self, messages: list[p.Message], add_generation_prompt: bool | None = None, extra: dict | None = None
    ) -> str:
        """The prompt text of a chat (400 for an empty one, one too long to fit, or one the template refuses)."""
        if not messages:
            raise p.RequestError(400, "messages must not be empty", "messages")
        texts = [m.text() for m in messages]
        self._check_length(sum(map(len, texts)), "messages")
        try:
            return self.codec.render_chat(
                [{"role": m.role, "content": t} for m, t in zip(messages, texts, strict=True)],
                add_generation_prompt is not False,
                extra,
            )
        except TemplateError as e:
            raise p.RequestError(400, str(e), "messages") from None

    def _encode(self, text: str, param: str) -> list[int]:
        self._check_length(len(text), param)
        return self.codec.encode(text)

    def _check_length(self, chars: int, param: str) -> None:
        """400 before any tokenization for a text too long for the context whatever it says."""
        most = self.context_tokens * self.codec.max_token_chars
        if chars > most:
            raise p.RequestError(
                400,
                f"the prompt of {chars} characters cannot fit the model's context of {self.context_tokens} tokens "
                f"(a token stands for at most {self.codec.max_token_chars} characters)",
                param,
            )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise p.RequestError(404, f"the model {model!r} does not exist; this server serves {self.model!r}", "model")

    def _check_ids(self, ids: list[int], param: str) -> None:
        try:
            as_array = np.frombuffer(array.array("q", ids), np.int64) if ids else None  # (a third of min(), max())
        except OverflowError:
            as_array = np.array([-1])
        if as_array is not None and not (as_array.min() >= 0 and as_array.max() < self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise p.RequestError(400, f"token id {bad} is outside the vocabulary (0…{self.vocab_size - 1})", param)

    def _jobs(
        self,
        req: p._Common,
        ids: list[int],
        max_tokens: int | None,
        default_max: int | None,
        logprobs: int | None,
        arrival: float,
        max_param: str = "max_tokens",
    ) -> list[Job]:
        """Validate a request for ``ids`` (400s, see the module doc) into one job per choice."""
        if not ids:
            raise p.RequestError(400, "the prompt is empty", "prompt")
        self._check_ids(ids, "prompt")
        room = self.context_tokens - len(ids)
        if room < 1:
            raise p.RequestError(
                400,
                f"the prompt of {len(ids)} tokens is longer than the model's context of "
                f"{self.context_tokens} tokens (it must leave room for one new token)",
                "prompt",
            )
        if max_tokens is not None and max_tokens < 1:
            raise p.RequestError(400, f"{max_param} must be at least 1, got {max_tokens}", max_param)
        if max_tokens is not None and max_tokens > room:
            raise p.RequestError(
                400,
                f"{len(ids)} prompt tokens + {max_param} {max_tokens} exceed the model's "
                f"context of {self.context_tokens} tokens",
                max_param,
            )
        cache = self.limits.cache_tokens
        if max_tokens is not None and cache is not None and len(ids) + max_tokens > cache:
            raise p.RequestError(
                400,
                f"{len(ids)} prompt tokens + {max_param} {max_tokens} need more KV than a worker's cache holds "
                f"({cache} tokens, --cache-tokens)",
                max_param,
            )
        if max_tokens is None:
            max_tokens = min(default_max or room, room, max(1, (cache or room + len(ids)) - len(ids)))
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_CHOICES:
            raise p.RequestError(400, f"n must be in 1…{MAX_CHOICES}, got {n}", "n")
        sampling = self._sampling(req, max_tokens, logprobs)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        return [
            Job(ids, max_tokens, {**sampling, "seed": (seed + i * SEED_STEP) % (1 << 64)}, stops, arrival, i)
            for i in range(n)
        ]

    def _sampling(self, req: p._Common, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """The worker protocol's sampling fields of ``req`` (400 naming the field for a value out of range)."""

        def within(name: str, value: float | None, default: float, lo: float, hi: float, low_open: bool = False):
            v = default if value is None else value
            if not (lo < v if low_open else lo <= v) or v > hi:
                raise p.RequestError(400, f"{name} must be in {'(' if low_open else '['}{lo}, {hi}], got {v}", name)
            return v

        top_k = 0 if req.top_k in (None, -1) else req.top_k
        if top_k < 0:
            raise p.RequestError(400, f"top_k must be -1, 0 (every token) or at least 1, got {req.top_k}", "top_k")
        min_tokens = int(within("min_tokens", req.min_tokens, 0, 0, max_tokens))
        bias: dict[str, float] = {}
        for key, value in (req.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < self.vocab_size or not -100 <= value <= 100:
                raise p.RequestError(
                    400, f"logit_bias maps token ids (0…{self.vocab_size - 1}) to biases in [-100, 100]", "logit_bias"
                )
            bias[str(int(key))] = value
        stop_ids = list(req.stop_token_ids or [])
        self._check_ids(stop_ids, "stop_token_ids")
        eos = [] if req.ignore_eos else sorted(self.codec.eos_token_ids)
        out = {
            "temperature": within("temperature", req.temperature, 1.0, 0, 2),
            "top_p": within("top_p", req.top_p, 1.0, 0, 1, low_open=True),
            "top_k": top_k,
            "min_p": within("min_p", req.min_p, 0.0, 0, 1),
            "presence_penalty": within("presence_penalty", req.presence_penalty, 0.0, -2, 2),
            "frequency_penalty": within("frequency_penalty", req.frequency_penalty, 0.0, -2, 2),
            "repetition_penalty": within("repetition_penalty", req.repetition_penalty, 1.0, 0, 2, low_open=True),
            "min_tokens": min_tokens,
            "stop_token_ids": sorted(set(eos) | set(stop_ids)),
        }
        if bias:
            out["logit_bias"] = bias
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out

    # -- admission ---------------------------------------------------------------------------------------

    def _admit(self, jobs: list[Job]) -> None:
        """400 for what could never be admitted, 503 while a pool has no worker up, 429 past the queue limits;
        else the jobs count as queued until their first tokens."""
        limits, prompt = self.limits, len(jobs[0].prompt)
        if len(jobs) > limits.max_queued_requests:
            raise p.RequestError(
                400, f"n {len(jobs)} is more than the server ever queues (--max-queued-requests "
                f"{limits.max_queued_requests})", "n"
            )  # fmt: skip
        if prompt * len(jobs) > limits.max_queued_tokens:
            raise p.RequestError(
                400, f"{prompt * len(jobs)} prompt tokens are more than the server ever queues (--max-queued-tokens "
                f"{limits.max_queued_tokens})", "prompt"
            )  # fmt: skip
        if not self.serving():
            raise p.RequestError(503, f"not ready ({self.ready()[1]}); retry shortly", retry_after_s=5)
        reason = None
        if self.queued_requests + len(jobs) > limits.max_queued_requests:
            reason = "requests"
        elif self.queued_tokens + prompt * len(jobs) > limits.max_queued_tokens:
            reason = "tokens"
        if reason:
            self.metrics.rejections.labels(reason).inc()
            engines = max(1, len(self.prefill) or len(self.both))
            wait = max(1, math.ceil(self.cost.prefill_s(self.queued_tokens, 0) / engines))
            raise p.RequestError(
                429,
                f"the server is at its limit of queued {reason} "
                f"({self.queued_requests} requests, {self.queued_tokens} tokens); retry in {wait} s",
                retry_after_s=wait,
            )
        for job in jobs:
            job.queued = True
            self.queued_requests += 1
            self.queued_tokens += prompt
            self.metrics.prompt_tokens.inc(prompt)

    def _dequeue(self, job: Job) -> None:
        if job.queued:
            job.queued = False
            self.queued_requests -= 1
            self.queued_tokens -= len(job.prompt)

    def _first_token(self, job: Job) -> None:
        job.first_at = self.clock()
        self.metrics.ttft.observe(job.first_at - job.arrival)
        self._dequeue(job)

    # -- one job on the workers ----------------------------------------------------------------------

    async def _tokens(self, job: Job) -> AsyncIterator[tuple[int, list[Any] | None]]:
        """The job's tokens as the workers make them, each with its ``[logprob, top_logprobs]`` when asked; sets
        ``job``'s outcome. Raises WorkerError. Closing it early aborts the request on its worker."""
        request = {"prompt": job.prompt, **job.sampling}
        try:
            if self.both:
                worker = min(self.both, key=lambda w: (not w.ready, len(w.running)))
                final = None
                async for event in worker.events({**request, "max_new_tokens": job.max_tokens, "stream": True}):
                    if "token" in event:
                        if job.first_at is None:
                            self._first_token(job)
                        yield event["token"], _logprob(event)
                    else:
                        final = event
                self._outcome(job, final)
                return
            cost = self.cost.prefill_s(len(job.prompt), 0)
            e = self.balancer.route(len(job.prompt), cost, self.clock(), [w.ready for w in self.prefill])
            try:
                async for event in self.prefill[e].events(request, kv_tokens=len(job.prompt)):
                    final = event
            finally:
                self.balancer.done(e, cost)
            self._outcome(job, final, decode=False)
            first = final["first_token"]
            self._first_token(job)
            if first is None:
                return
            yield first, (final.get("logprobs") or [None])[0]
            if final["finish_reason"] == "stop" or job.max_tokens == 1:
                job.finish_reason = final["finish_reason"] or "length"
                return
            ready = [w for w in self.decode if w.ready] or self.decode
            kv = [sum(w.running.values()) for w in ready]
            running = [len(w.running) for w in ready]
            worker = ready[pick_decode(running, kv, len(job.prompt) + 1, self.cost, tbt_slo_s=self.tbt_slo_s)]
            decode = {**request, "max_new_tokens": job.max_tokens, "first_token": first, "stream": True}
            skip_first = True  # the decode worker streams the first token it was given, too
            async for event in worker.events(decode, kv_tokens=len(job.prompt)):
                if "token" in event:
                    if not skip_first:
                        yield event["token"], _logprob(event)
                    skip_first = False
                else:
                    final = event
            self._outcome(job, final, decode=True)
        finally:
            self._dequeue(job)

    def _outcome(self, job: Job, final: dict[str, Any] | None, decode: bool = False) -> None:
        if final is None or "error" in final or "aborted" in final:
            raise WorkerError((final or {}).get("error", "the worker ended the request"))
        job.finish_reason = final["finish_reason"]
        if final.get("store_timeout") and not job.store_timeout:
            job.store_timeout = True
            self.metrics.store_timeouts.inc()
        if not decode:  # the prompt's reuse is the prefill's (or the one engine's); decode resumes a handoff
            job.hit_tokens, job.replayed = final["hit_tokens"], final["replayed"]
            self.metrics.hit_tokens.inc(job.hit_tokens)
            self.metrics.replays.inc(job.replayed)

    async def _deltas(self, job: Job) -> AsyncIterator[Delta]:
        """The job's text deltas with their tokens' logprobs; stops at a stop string (``finish_reason`` "stop"),
        looked for once ``min_tokens`` tokens are made."""
        detok = Detokenizer(self.codec, job.stops, job.min_tokens)
        tokens = self._tokens(job)
        pending: list[tuple[int, float, list[list[Any]]]] = []
        first = True  # the first token's delta goes out at once, text or not: it is the client's first token
        try:
            async for token, logprob in tokens:
                job.generated.append(token)
                if logprob is not None:
                    pending.append((token, logprob[0], logprob[1]))
                text = detok.add(token)
                if detok.stopped:
                    job.finish_reason = "stop"
                    self.metrics.aborts.labels("stop_string").inc()
                    yield Delta(text, pending)
                    return
                if text or first:
                    yield Delta(text, pending)
                    pending, first = [], False
            yield Delta(detok.flush(), pending)
        except WorkerError:
            self.metrics.aborts.labels("error").inc()
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the consumer went away: the client disconnected
            self.metrics.aborts.labels("disconnect").inc()
            raise
        finally:
            await tokens.aclose()
            self._finished(job)

    def _finished(self, job: Job) -> None:
        m = self.metrics
        m.generated.inc(len(job.generated))
        if job.first_at is not None and len(job.generated) > 1:
            m.tpot.observe((self.clock() - job.first_at) / (len(job.generated) - 1))

    def _usage(self, jobs: list[Job]) -> dict[str, Any]:
        return p.usage(len(jobs[0].prompt), sum(len(j.generated) for j in jobs), max(j.hit_tokens for j in jobs))

    # -- answers -----------------------------------------------------------------------------------------

    async def _whole(self, jobs: list[Job]) -> list[tuple[str, list[Any]]]:
        """Every job's whole text and logprobs (WorkerError if one fails; the others are aborted)."""

        async def collect(job: Job) -> tuple[str, list[Any]]:
            text, logprobs = [], []
            async for d in self._deltas(job):
                text.append(d.text)
                logprobs += d.logprobs
            return "".join(text), logprobs

        tasks = [asyncio.ensure_future(collect(j)) for j in jobs]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(
        self,
        jobs: list[Job],
        chunk: Callable[[Job, str, str | None, list[Any]], dict[str, Any]],
        usage: Callable[[], dict[str, Any]] | None,
    ) -> AsyncIterator[bytes]:
        """SSE chunks of every job's deltas as they come, each job's ``finish_reason`` chunk, the usage chunk, and
        ``[DONE]``. An error before the first chunk is raised (the response has not started: the app answers
        with an HTTP error); after it, it is sent as an error event and the stream ends."""
        events: asyncio.Queue[tuple[Job, Delta | BaseException | None]] = asyncio.Queue()

        async def feed(job: Job) -> None:
            try:
                async for d in self._deltas(job):
                    await events.put((job, d))
                await events.put((job, None))
            except WorkerError as e:
                await events.put((job, e))

        tasks = [asyncio.ensure_future(feed(j)) for j in jobs]
        started, left = False, len(jobs)
        try:
            while left:
                job, item = await events.get()
                if isinstance(item, BaseException):
                    if not started:
                        raise item
                    yield p.sse(p.error_body(str(item), "server_error", None, 500))
                    yield p.sse("[DONE]")
                    return
                if item is None:
                    left -= 1
                    yield p.sse(chunk(job, "", job.finish_reason, []))
                elif item.text or item.logprobs or not started:
                    yield p.sse(chunk(job, item.text, None, item.logprobs))
                started = True
            if usage is not None:
                yield p.sse(usage())
            yield p.sse("[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _completion_logprobs(self, job: Job, entries: list[tuple[int, float, list[list[Any]]]]) -> dict[str, Any]:
        """vLLM's completions ``logprobs``: tokens, their logprobs, the chosen and top tokens' logprobs, offsets."""
        text = self.codec.token_text
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in entries:
            out["tokens"].append(text(token))
            out["token_logprobs"].append(_floor(logprob))
            out["top_logprobs"].append({text(token): _floor(logprob)} | {text(t): _floor(lp) for t, lp in top})
            out["text_offset"].append(job.text_offset)
            job.text_offset += len(text(token))
        return out

    def _chat_logprobs(self, job: Job, entries: list[tuple[int, float, list[list[Any]]]]) -> dict[str, Any]:
        """OpenAI's (and vLLM's) chat ``logprobs``: ``content``, one entry a token with its top alternatives."""

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.codec.token_text(token)
            return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode())}

        content = [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]} for t, lp, top in entries]
        return {"content": content}


def _include_usage(req: p._Common) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _logprob(event: dict[str, Any]) -> list[Any] | None:
    return [event["logprob"], event["top_logprobs"]] if "logprob" in event else None


def _floor(logprob: float) -> float:
    return max(logprob, -9999.0)  # vLLM's floor: JSON has no -inf
