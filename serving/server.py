"""The server object behind the routes: validates a request into a :class:`Job`, admits it or refuses it (429),
routes it to the workers through the balancers, and turns the tokens that come back into OpenAI responses or
server-sent events (async generators). It holds no KV and imports no model code: it talks to workers.

One request, in order:

1. validate (400: malformed JSON, unknown model, empty or too long a prompt, ``max_tokens`` < 1, token ids
   outside the vocabulary, sampling settings out of range, options this server does not implement);
2. admit: past ``max_queued_requests`` or ``max_queued_tokens`` of requests still waiting for their first
   token, 429 with ``Retry-After`` (the queued prefill work over the prefill engines, predicted by the cost
   model, at least 1 s), before any response starts;
3. P/D: the prefill balancer picks a prefill worker, which reuses what the store holds, computes the rest, stores
   it and chooses the first token; the decode balancer picks a decode worker, which resumes from the store and
   streams the other tokens. Embedded: the one engine does both;
4. tokens → text deltas (stop strings end the answer with ``finish_reason: "stop"``, and the request is aborted
   on its worker); usage with ``prompt_tokens_details.cached_tokens`` = the prompt tokens reused from the store.

An error after a stream began is sent as an SSE error event; a client that goes away, a stop string or any
error closes the token generator, which aborts the request on its worker.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.serving import protocol as p
from kvtier.serving.cost import CostModel
from kvtier.serving.decode_balance import pick_decode
from kvtier.serving.metrics import Metrics
from kvtier.serving.prefill_balance import DEFAULT_EDGES, PrefillBalancer
from kvtier.serving.text import Detokenizer, TemplateError, TextCodec
from kvtier.serving.workers import Worker

TOKEN_PROXY = CostModel(0.0, 1e-4, 0.0)  # without a fitted model: cost ∝ new tokens (0.1 ms each)


@dataclass(frozen=True)
class Limits:
    max_queued_requests: int = 256
    max_queued_tokens: int = 1 << 20


@dataclass
class Job:
    """One admitted request and what became of it."""

    prompt: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stops: list[str]
    stream: bool
    include_usage: bool
    arrival: float
    queued: bool = False
    hit_tokens: int = 0
    replayed: bool = False
    finish_reason: str | None = None
    generated: list[int] = field(default_factory=list)
    first_at: float | None = None


class WorkerError(Exception):
    """A worker failed a request (it exited, or answered an error)."""


class Server:
    """Serves one model from its ``prefill`` and ``decode`` workers (P/D), or from ``both`` (embedded)."""

    def __init__(
        self,
        codec: TextCodec,
        model: str,
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
    ) -> None:
        if bool(prefill) != bool(decode) or bool(prefill) == bool(both):
            raise ValueError("give prefill and decode workers, or embedded ones, not both kinds")
        self.codec, self.model, self.context_tokens, self.vocab_size = codec, model, context_tokens, vocab_size
        self.prefill, self.decode, self.both = list(prefill), list(decode), list(both)
        self.cost = cost or TOKEN_PROXY
        self.tbt_slo_s = tbt_slo_s  # the decode balancer's rule 3 (serving.decode_balance)
        self.limits, self.clock = limits, clock
        self.balancer = PrefillBalancer(max(1, len(self.prefill)), window_s, edges)
        self.metrics = Metrics()
        self.queued_requests = 0
        self.queued_tokens = 0

    # -- lifecycle -------------------------------------------------------------------------------------

    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode, *self.both]

    async def start(self) -> None:
        for w in self.workers():
            await w.start()

    def stop(self) -> None:
        """Stop every worker, all at once (each may take its time to exit)."""
        stops = [threading.Thread(target=w.stop) for w in self.workers()]
        for t in stops:
            t.start()
        for t in stops:
            t.join()

    def ready(self) -> tuple[bool, str]:
        """Whether every pool has a worker up (``GET /health``), and a line saying which are."""
        pools = {"prefill": self.prefill, "decode": self.decode} if self.prefill else {"engine": self.both}
        up = {name: sum(w.ready for w in ws) for name, ws in pools.items()}
        ok = all(up[name] > 0 for name in pools)
        return ok, ", ".join(f"{name} {up[name]}/{len(ws)} up" for name, ws in pools.items())

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

    async def completion(self, body: bytes) -> dict[str, Any] | AsyncIterator[bytes]:
        """``POST /v1/completions``: a ``text_completion`` object, or its SSE stream (an async generator)."""
        req: p.CompletionRequest = p.decode(body, p.CompletionRequest)
        if req.echo or req.suffix is not None or (req.best_of or 1) != 1:
            raise p.RequestError(400, "echo, suffix and best_of are not supported", "echo")
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise p.RequestError(400, "one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(type(t) is int for t in prompt):
            raise p.RequestError(
                400, "prompt must be a string, a list of token ids, or a list of one of either", "prompt"
            )
        ids = self.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        job = self._job(req, ids, req.max_tokens, default_max=16)
        return await self._respond(job, "cmpl", self._stream_completion, p.completion)

    async def chat(self, body: bytes) -> dict[str, Any] | AsyncIterator[bytes]:
        """``POST /v1/chat/completions``: a ``chat.completion`` object, or its SSE stream."""
        req: p.ChatRequest = p.decode(body, p.ChatRequest)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = self._job(req, self.codec.encode(self._render(req.messages)), limit, default_max=None)
        return await self._respond(job, "chatcmpl", self._stream_chat, p.chat_completion)

    async def _respond(
        self,
        job: Job,
        prefix: str,
        stream: Callable[[str, Job, AsyncIterator[str]], AsyncIterator[bytes]],
        whole: Callable[..., dict[str, Any]],
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        """The answer to an admitted ``job``: its SSE stream, or the whole object once it is complete."""
        rid = p.new_id(prefix)
        answer = self._answer(job)
        if job.stream:
            return stream(rid, job, answer)
        text = "".join([d async for d in answer])
        return whole(rid, self.model, text, job.finish_reason, self._usage(job))

    def _render(self, messages: list[p.Message]) -> str:
        """The prompt text of a chat (400 for an empty one or one the template refuses)."""
        if not messages:
            raise p.RequestError(400, "messages must not be empty", "messages")
        try:
            return self.codec.render_chat([{"role": m.role, "content": m.text()} for m in messages])
        except TemplateError as e:
            raise p.RequestError(400, str(e), "messages") from None

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "kvtier",
            "max_model_len": self.context_tokens,
        }
        return {"object": "list", "data": [card]}

    def tokenize(self, body: bytes) -> dict[str, Any]:
        """``POST /tokenize``: ``{"model"?, "prompt"}`` or ``{"model"?, "messages"}`` → ``{"tokens", "count",
        "max_model_len"}``."""
        req = p.decode(body, dict[str, Any])
        self._check_model(req.get("model"))
        if "messages" in req:
            text = self._render(p.decode(p.msgspec.json.encode(req["messages"]), list[p.Message]))
        elif isinstance(req.get("prompt"), str):
            text = req["prompt"]
        else:
            raise p.RequestError(400, "give prompt (a string) or messages", "prompt")
        ids = self.codec.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.context_tokens}

    def detokenize(self, body: bytes) -> dict[str, Any]:
        """``POST /detokenize``: ``{"model"?, "tokens": [ids]}`` → ``{"prompt": text}``."""
        req = p.decode(body, dict[str, Any])
        self._check_model(req.get("model"))
        tokens = req.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise p.RequestError(400, "tokens must be a list of token ids", "tokens")
        self._check_ids(tokens, "tokens")
        return {"prompt": self.codec.decode(tokens)}

    # -- one request -----------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise p.RequestError(400, f"the model {model!r} does not exist; this server serves {self.model!r}", "model")

    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise p.RequestError(400, f"token id {bad[0]} is outside the vocabulary (0…{self.vocab_size - 1})", param)

    def _job(self, req: Any, ids: list[int], max_tokens: int | None, default_max: int | None) -> Job:
        """Validate (400s, see the module doc), then admit (429) a request for ``ids``; 503 while a pool has no
        worker up."""
        self._check_model(req.model)
        if req.n != 1:
            raise p.RequestError(400, "n must be 1", "n")
        if req.logprobs not in (None, False):
            raise p.RequestError(400, "logprobs are not supported", "logprobs")
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
            raise p.RequestError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and max_tokens > room:
            raise p.RequestError(
                400,
                f"{len(ids)} prompt tokens + max_tokens {max_tokens} exceed the model's "
                f"context of {self.context_tokens} tokens",
                "max_tokens",
            )
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 <= temperature <= 2:
            raise p.RequestError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
        if not 0 < top_p <= 1:
            raise p.RequestError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        eos = [] if req.ignore_eos else sorted(self.codec.eos_token_ids)
        sampling = {"temperature": temperature, "top_p": top_p, "seed": seed, "stop_token_ids": eos}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        job = Job(
            ids, max_tokens or min(default_max or room, room), sampling, stops, req.stream, include_usage, self.clock()
        )
        ok, line = self.ready()
        if not ok:
            raise p.RequestError(503, f"not ready ({line}); retry shortly", retry_after_s=5)
        self._admit(job)
        return job

    def _admit(self, job: Job) -> None:
        limits = self.limits
        reason = None
        if self.queued_requests + 1 > limits.max_queued_requests:
            reason = "requests"
        elif self.queued_tokens + len(job.prompt) > limits.max_queued_tokens:
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
        job.queued = True
        self.queued_requests += 1
        self.queued_tokens += len(job.prompt)
        self.metrics.prompt_tokens.inc(len(job.prompt))

    def _dequeue(self, job: Job) -> None:
        if job.queued:
            job.queued = False
            self.queued_requests -= 1
            self.queued_tokens -= len(job.prompt)

    def _first_token(self, job: Job) -> None:
        job.first_at = self.clock()
        self.metrics.ttft.observe(job.first_at - job.arrival)
        self._dequeue(job)

    async def _tokens(self, job: Job) -> AsyncIterator[int]:
        """The answer's tokens as the workers make them; sets ``job``'s outcome. Raises WorkerError. Closing it
        early aborts the request on its worker."""
        request = {"prompt": job.prompt, **job.sampling}
        try:
            if self.both:
                worker = min(self.both, key=lambda w: (not w.ready, len(w.running)))
                final = None
                async for event in worker.events({**request, "max_new_tokens": job.max_tokens, "stream": True}):
                    if "token" in event:
                        if job.first_at is None:
                            self._first_token(job)
                        yield event["token"]
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
            yield first
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
                        yield event["token"]
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
        if not decode:  # the prompt's reuse is the prefill's (or the one engine's); decode resumes a handoff
            job.hit_tokens, job.replayed = final["hit_tokens"], final["replayed"]
            self.metrics.hit_tokens.inc(job.hit_tokens)
            self.metrics.replays.inc(job.replayed)

    async def _answer(self, job: Job) -> AsyncIterator[str]:
        """Text deltas of the answer; stops at a stop string (``finish_reason`` "stop")."""
        detok = Detokenizer(self.codec, job.stops)
        tokens = self._tokens(job)
        try:
            async for token in tokens:
                job.generated.append(token)
                delta = detok.add(token)
                if detok.stopped:
                    job.finish_reason = "stop"
                    self.metrics.aborts.labels("stop_string").inc()
                    if delta:
                        yield delta
                    return
                if delta:
                    yield delta
            if rest := detok.flush():
                yield rest
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

    def _usage(self, job: Job) -> dict[str, Any]:
        return p.usage(len(job.prompt), len(job.generated), job.hit_tokens)

    async def _stream_completion(self, rid: str, job: Job, answer: AsyncIterator[str]) -> AsyncIterator[bytes]:
        async for chunk in self._stream(job, answer, lambda d, f: p.completion(rid, self.model, d, f, None)):
            yield chunk
        if job.include_usage:
            yield p.sse({**p.completion(rid, self.model, "", None, self._usage(job)), "choices": []})
        yield p.sse("[DONE]")

    async def _stream_chat(self, rid: str, job: Job, answer: AsyncIterator[str]) -> AsyncIterator[bytes]:
        first = [True]

        def chunk(delta: str, finish: str | None) -> dict[str, Any]:
            body: dict[str, Any] = {"content": delta} if delta or finish is None else {}
            if first[0]:
                body["role"] = "assistant"
                first[0] = False
            return p.chat_chunk(rid, self.model, body, finish)

        async for data in self._stream(job, answer, chunk):
            yield data
        if job.include_usage:
            yield p.sse({**p.chat_chunk(rid, self.model, None, None), "usage": self._usage(job)})
        yield p.sse("[DONE]")

    async def _stream(
        self, job: Job, answer: AsyncIterator[str], chunk: Callable[[str, str | None], dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """SSE chunks of the deltas, then the one with ``finish_reason``. An error before the first chunk is
        raised (the response has not started: the app answers with an HTTP error); after it, it is sent as an
        error event and the stream ends."""
        started = False
        try:
            async for delta in answer:
                started = True
                yield p.sse(chunk(delta, None))
        except WorkerError as e:
            if not started:
                raise
            yield p.sse(p.error_body(str(e), "server_error", None, 500))
            return
        finally:
            await answer.aclose()
        yield p.sse(chunk("", job.finish_reason))
