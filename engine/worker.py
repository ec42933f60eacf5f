"""``kvtier-engine prefill``, ``decode`` and ``worker``: engine workers (P/D disaggregation, or both halves in one).

Each worker is its own process with its own model and paged cache; a prefill and a decode worker meet only
through the store (block KV) and the StateBlock directory (sliding-window state, pulled from the host that holds
it):

- **prefill** computes a prompt (reusing any stored prefix), stores its new full blocks, saves StateBlocks at
  every multiple of 128 plus one at the last block boundary before the final token (the handoff), and chooses
  the answer's first token;
- **decode** fetches the whole prompt's blocks and the handoff StateBlock, recomputes at most the last block,
  and generates (taking the prefill worker's first token when given it). Its output equals a single-process run;
- **worker** (``role="both"``) does both in one process: the embedded server's engine.

The protocol (:data:`PROTOCOL`, also in ``kvtier-engine prefill --help`` and ``docs/engine.md``), stdin → stdout,
one JSON object a line: the worker first prints
``{"ready": true, "role": ..., "state_host": "HOST:PORT" | null}``, then takes requests
``{"id", "prompt": [token ids], "max_new_tokens": n, sampling settings?, "first_token"? (decode), "stream"?}``
and ``{"abort": id}``; the sampling settings are :class:`~kvtier.engine.sampling.Sampling`'s, by the same names
(``logit_bias`` an object of token id → bias; ``logprobs`` the alternatives to report with each token). It works
on every request it holds at once (:class:`WorkerLoop`), so answers come in the order requests finish, each naming
its ``id``:

- prefill: ``{"id", "hit_tokens", "replayed", "ttft_s", "first_token", "finish_reason"}``;
- decode and both: ``{"id", "tokens", "finish_reason", "hit_tokens", "recomputed_tokens", "replayed",
  "ttft_s"}``, preceded with ``"stream": true`` by one ``{"id", "token"}`` line per token as it is made;
- with ``logprobs``: each token line also has ``"logprob"`` and ``"top_logprobs"`` (``[[id, logprob], ...]``, most
  likely first), and the answer ``"logprobs"``: ``[[logprob, top_logprobs], ...]`` for its tokens (prefill: the
  first token's);
- an abort: ``{"id", "aborted": true}`` once its pages are released (nothing if the id is not running);
- a bad request: ``{"id", "error": "one line"}``; the worker carries on. End of input ends the worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO

import msgspec
import torch

from kvtier.engine.checkpoint import DTYPES, read_config
from kvtier.engine.engine import Engine, Generation, PromptError
from kvtier.engine.formats import KVFormat
from kvtier.engine.sampling import Sampling
from kvtier.engine.scheduler import Scheduler, StepCost
from kvtier.engine.store_thread import StoreThread
from kvtier.kvstore.cluster.children import die_with_parent
from kvtier.kvstore.cluster.config import read_token_file
from kvtier.transfer.availability import Availability

log = logging.getLogger("kvtier.engine")

ROLES = ("prefill", "decode", "both")
PROTOCOL = """\
protocol: JSON lines, one object a line. The worker first prints
  {"ready": true, "role": "prefill"|"decode"|"both", "state_host": "HOST:PORT"|null}
then takes requests and aborts on stdin, and works on every request it holds at once:
  {"id": ANY, "prompt": [token ids], "max_new_tokens": N, "temperature"?, "top_p"?, "top_k"?, "min_p"?,
   "seed"?, "logit_bias"? {"ID": bias}, "presence_penalty"?, "frequency_penalty"?, "repetition_penalty"?,
   "min_tokens"?, "stop_token_ids"?, "logprobs"? N, "first_token"? (decode), "stream"?}      {"abort": ID}
answering each on stdout as it finishes, naming its id:
  prefill        {"id", "hit_tokens", "replayed", "ttft_s", "first_token", "finish_reason"}
  decode, both   {"id", "tokens", "finish_reason", "hit_tokens", "recomputed_tokens", "replayed", "ttft_s"}
                 (with "stream": true, first one {"id", "token"} line per token as it is made)
  with logprobs  "logprob" and "top_logprobs" [[id, logprob], ...] on each token line; "logprobs"
                 [[logprob, top_logprobs], ...] in the answer (prefill: the first token's)
  an abort       {"id", "aborted": true} once its pages are released
A request it cannot take is answered {"id", "error": "one line"} and the worker carries on; end of input ends it."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="Hugging Face model directory")
    p.add_argument("--store", required=True, help="cluster file, or its client file cluster.public.toml")
    p.add_argument(
        "--token-file",
        help="file holding the tenant token (mode 0600; default $KVTIER_TOKEN, else the cluster file's own token)",
    )
    p.add_argument("--directory", help="HOST:PORT of the kvtier-directory (StateBlocks across processes)")
    p.add_argument("--fetcher", help="Unix socket of this host's kvtier-fetcher (default: the store client)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--state-pool-bytes", type=int, default=256 << 20, help="StateBlock pool size (default 256 MiB)")
    p.add_argument("--cache-tokens", type=int, default=1 << 17, help="paged KV cache size in tokens (131072)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="queries per forward chunk (default 512)")
    p.add_argument(
        "--store-timeout-ms",
        type=float,
        default=2000.0,
        help="a store lookup taking longer makes its request compute instead of reuse (default 2000)",
    )
    p.add_argument("--max-num-seqs", type=int, help="requests run at once (default: as many as the cache holds)")
    p.add_argument(
        "--kv-format",
        default="exact",
        help="form of blocks and StateBlocks outside the device: exact (default), bf16, fp8-e4m3, mxfp8, mxfp4, seed "
        "or KIND=CODEC,... (docs/engine.md, KV formats)",
    )


def flags(args: argparse.Namespace, *adders: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    """The command-line flags that give a process the options ``adders`` register (default :func:`add_arguments`)
    with the values ``args`` holds: how a worker process is given every option the embedded engine gets, from this
    one list, so that no option is forgotten."""
    probe = argparse.ArgumentParser(add_help=False)
    for add in adders or (add_arguments,):
        add(probe)
    out: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest, None)
        if value is not None and action.option_strings:
            out += [action.option_strings[0], str(value)]
    return out


def check_kv_format(args: argparse.Namespace) -> None:
    """FormatError (one line) unless the model of ``--checkpoint`` takes ``--kv-format`` in ``--dtype`` (an
    UnsupportedModelError for a directory that holds none): what a process that starts workers asks first, since a
    worker refused its format exits, and is restarted, saying so each time. Reads ``config.json`` only."""
    family, config = read_config(args.checkpoint)
    dtype = DTYPES[args.dtype]
    parts = family.kv_parts(config, family.block_tokens(config, None), dtype)
    KVFormat.parse(args.kv_format).layouts(parts, dtype)


def open_engine(role: str, args: argparse.Namespace) -> Engine:
    """The engine a worker of ``role`` runs, from the arguments of :func:`add_arguments`."""
    torch.set_num_threads(args.threads)
    token = read_token_file(args.token_file) if args.token_file else None
    engine = Engine.from_pretrained(
        args.checkpoint,
        args.device,
        DTYPES[args.dtype],
        store=args.store,
        token=token,
        fetcher=args.fetcher,
        directory=args.directory,
        host_id=f"{role}-{os.getpid()}",
        state_pool_bytes=args.state_pool_bytes,
        cache_tokens=args.cache_tokens,
        chunk_tokens=args.chunk_tokens,
        kv_format=args.kv_format,
    )
    engine.handoff = role == "prefill"
    return engine


def loop_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`WorkerLoop` options of the arguments of :func:`add_arguments`."""
    return {"store_timeout_s": args.store_timeout_ms / 1e3, "max_running": args.max_num_seqs}


def remove_leftovers(role: str, pid: int, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the shared memory a ``role`` worker of process ``pid`` left behind when it died without closing its
    engine (its StateBlock pool, named after its host id ``ROLE-PID``); returns the names removed. For the
    process that started the worker, once the worker has exited."""
    removed = []
    for path in shm_dir.glob(f"kvtier-state-{role}-{pid}-*"):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def ready_line(engine: Engine, role: str) -> dict[str, Any]:
    host = getattr(engine.state_blocks, "addr", None)  # a StateBlockHost serves at this address
    return {"ready": True, "role": role, "state_host": f"{host[0]}:{host[1]}" if host else None}


def serve(
    role: str,
    args: argparse.Namespace,
    requests: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
    cost: StepCost | None = None,
    step_budget_s: float = 0.0,
) -> None:
    """Run a worker of ``role`` on JSON lines from ``requests`` until they end (the module doc's protocol)."""
    with open_engine(role, args) as engine:
        _say(out, ready_line(engine, role))
        loop = WorkerLoop(engine, role, lambda event: _say(out, event), cost, step_budget_s, **loop_options(args))
        reader = threading.Thread(target=_read_lines, args=(requests, loop), daemon=True)
        reader.start()
        loop.run()


def _read_lines(requests: TextIO, loop: WorkerLoop) -> None:
    for line in requests:
        if line.strip():
            loop.submit(line)
    loop.submit(None)


@dataclass
class _Waiting:
    rid: Any
    start: Callable[[bool], Generation]  # (reuse) -> the request's generation
    stream: bool
    reuse: bool = True  # False once a lookup of its ran past the deadline (or the store was stalled)
    preempted: Generation | None = None  # its generation, when it ran and was preempted
    prompt_tokens: int = 0  # tokens it needs pages for to start: its prompt (after a preemption every token)


@dataclass
class _Running:
    request: _Waiting
    generation: Generation
    lookup_until: float | None = None  # its lookup runs on the store thread until this deadline (monotonic)
    answer: dict[str, Any] | None = None  # a prefill's answer, said once its blocks are stored (the handoff)

    @property
    def rid(self) -> Any:
        return self.request.rid

    @property
    def steppable(self) -> bool:
        return self.lookup_until is None


Inbox = queue.Queue[str | dict[str, Any] | Callable[[], None] | None]


class WorkerLoop:
    """The protocol side of one engine: requests in (:meth:`submit`, from any thread), events out (``emit``, called
    on the loop's thread, in the module doc's shapes); a :class:`~kvtier.engine.scheduler.Scheduler` steps them.

    Each iteration takes what was submitted, admits waiting requests (preempted ones first, then in arrival order)
    while the pages of their prompt are free and fewer than ``max_running`` run, then runs one *step*: one forward
    for a token of every request that is decoding and prefill chunks of the prompts being computed, the least
    prompt left first (a short prompt never waits for a long one to finish), within the step's time budget: with
    ``cost``, the largest chunks ``t(q, c)`` fits in what ``step_budget_s`` leaves after the decode tokens; without
    it a prompt is computed whole. Pages are taken as tokens are computed; when they run out, the requests admitted
    last are preempted and resumed later (the scheduler's doc), never failed. A request whose prompt alone is more
    than the cache holds is refused; one whose answer outgrows the whole cache ends there (``"length"``). An abort
    takes effect between steps (or removes a waiting request).

    With ``store_timeout_s`` (and a store) every store call runs on a :class:`StoreThread`, never in a step: a
    request's lookup (match and fetch) runs there while the others step, and its new blocks are put from there. A
    lookup still running after ``store_timeout_s`` is left to end by itself (its pages are released then) and its
    request starts again without reuse: it computes its prompt, its answer says ``"store_timeout": true``, and it
    is counted (``stats``) and said in one line (one more when lookups are in time again). While the store thread
    is stalled (a call running past the deadline) new requests compute without asking the store and new blocks are
    not stored.

    Not thread-safe except :meth:`submit` (and putting into ``inbox``, the queue it reads, which a caller may make
    before the engine exists)."""

    def __init__(
        self,
        engine: Engine,
        role: str,
        emit: Callable[[dict[str, Any]], None],
        cost: StepCost | None = None,
        step_budget_s: float = 0.0,
        inbox: Inbox | None = None,
        store_timeout_s: float | None = None,
        max_running: int | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.engine, self.role, self.emit = engine, role, emit
        self.scheduler = Scheduler(engine, cost, step_budget_s)
        self.inbox: Inbox = inbox if inbox is not None else queue.Queue()
        self.max_running = max_running
        self.running: dict[Any, _Running] = {}  # in arrival order
        self.waiting: deque[_Waiting] = deque()  # for cache pages: preempted ones first, then in arrival order
        self.store_timeouts = 0
        self.store_timeout_s = store_timeout_s
        self.store_thread: StoreThread | None = None
        if store_timeout_s is not None and engine.store is not None:
            self.store_thread = StoreThread(self.inbox.put, store_timeout_s)
            engine.background = self.store_thread.submit
        self.lookups = Availability(
            f"the store (a lookup within --store-timeout-ms {(store_timeout_s or 0) * 1e3:g})",
            "requests compute their prompts instead",
            log,
        )
        self._open = True

    def submit(self, request: str | dict[str, Any] | None) -> None:
        """A request (a JSON line or its object), an abort, or None: no more requests (the loop ends when the
        requests it holds are done)."""
        self.inbox.put(request)

    def stats(self) -> dict[str, int]:
        """``store_timeouts``: requests that computed their prompts because the store did not answer in time;
        ``store_calls_skipped``: store calls not made while the store thread was stalled."""
        skipped = self.store_thread.refused if self.store_thread is not None else 0
        return {"store_timeouts": self.store_timeouts, "store_calls_skipped": skipped}

    def run(self) -> None:
        try:
            while self._open or self.running or self.waiting:
                self._take(self._wait_s())
                self._expire_lookups()
                self._start_waiting()
                self._step()
        finally:
            for r in list(self.running.values()):
                self._end(r)
            for w in self.waiting:
                if w.preempted is not None:
                    w.preempted.close()
            self.waiting.clear()
            if self.store_thread is not None:
                self.engine.background = None
                if self.store_thread.stop():
                    self._take(0.0)  # the last calls' ends: their pages come back

    def _wait_s(self) -> float | None:
        """How long to wait for the inbox: not at all while a request can step (or the loop ends); until the nearest
        lookup's deadline while lookups run; for good while requests wait for pages (abandoned lookups give
        them back through the inbox) or nothing runs."""
        if any(r.steppable for r in self.running.values()) or self._can_start():
            return 0.0
        deadlines = [r.lookup_until for r in self.running.values() if r.lookup_until is not None]
        if deadlines and min(deadlines) < math.inf:  # (a resume's lookup has none: its end wakes the loop)
            return max(0.0, min(deadlines) - time.monotonic())
        return None if self._open or self.waiting else 0.0

    def _take(self, wait_s: float | None) -> None:
        while True:
            try:
                item = self.inbox.get(block=wait_s != 0, timeout=wait_s)
            except queue.Empty:
                return
            wait_s = 0.0
            if item is None:
                self._open = False
            elif callable(item):  # a store call's end (StoreThread.post)
                item()
            else:
                self._accept(item)

    def _accept(self, item: str | dict[str, Any]) -> None:
        rid = None
        try:
            request = msgspec.json.decode(item) if isinstance(item, str) else item
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
            if "abort" in request:
                self._abort(request["abort"])
                return
            rid = request.get("id")
            if rid in self.running or any(w.rid == rid for w in self.waiting):
                raise ValueError(f"request id {rid!r} is already running")
            prompt = request["prompt"]
            if not isinstance(prompt, list):
                raise ValueError("prompt must be a list of token ids")
            sampling = sampling_of(request, self.engine.config.vocab_size)
            new = 1 if self.role == "prefill" else int(request.get("max_new_tokens", 16))
            if new < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {new}")
            first = request.get("first_token") if self.role == "decode" else None
        except (ValueError, KeyError, TypeError, AttributeError, msgspec.DecodeError) as e:
            self.emit({"id": rid, "error": f"bad request: {e}"})
            return
        held = self.engine.cache.num_pages * self.engine.block_tokens
        if len(prompt) > held:
            self.emit({"id": rid, "error": f"the prompt needs {len(prompt)} tokens of KV; this worker's cache holds "
                                           f"{held} (--cache-tokens)"})  # fmt: skip
            return
        try:  # checked now (ids, converted once); the engine starts it once its pages are free
            ids = self.engine.check_prompt(prompt)
        except PromptError as e:
            self.emit({"id": rid, "error": str(e)})
            return
        resume = self.role == "decode"

        def start(reuse: bool) -> Generation:
            return self.engine.start(prompt, new, sampling, reuse=reuse, resume=resume, first_token=first, ids=ids)

        stream = bool(request.get("stream")) and self.role != "prefill"
        self.waiting.append(_Waiting(rid, start, stream, prompt_tokens=len(prompt)))

    def _start_waiting(self) -> None:
        """Start waiting requests in order (preempted ones are first) while the pages of their prompt are free and
        fewer than ``max_running`` run; a preempted one once its pages have come back."""
        while self._can_start():
            w = self.waiting.popleft()
            g = w.preempted
            if g is None:
                if w.reuse and self.store_thread is not None and self.store_thread.stalled():
                    self._count_timeout(w, "a store call is still running past the deadline")
                g = w.start(w.reuse)
            self.engine.runner.ensure_pages(g.seq, g.seq.prefill)
            r = self.running[w.rid] = _Running(w, g)
            g.on_release = lambda r=r: self._released(r)
            if g.preemptions:  # a resume: its lookup (a refetch) has no deadline, and a stalled store means recompute
                if g.refetch and self.store_thread is not None:
                    r.lookup_until = math.inf
                    if not g.in_background(g.lookup, lambda r=r, g=g: self._looked_up(r, g)):
                        r.lookup_until, g.refetch = None, False
            elif w.reuse and self.store_thread is not None:
                r.lookup_until = time.monotonic() + (self.store_timeout_s or 0.0)
                if not g.in_background(g.lookup, lambda r=r, g=g: self._looked_up(r, g)):
                    self._compute_instead(r, "the store thread is stalled")

    def _can_start(self) -> bool:
        if not self.waiting or (self.max_running is not None and len(self.running) >= self.max_running):
            return False
        w = self.waiting[0]
        if w.preempted is not None and w.preempted.preempting:
            return False  # its pages are not back yet
        held = len(w.preempted.seq.pages) if w.preempted is not None else 0
        return -(-w.prompt_tokens // self.engine.block_tokens) - held <= self.engine.cache.free_pages

    def _released(self, r: _Running) -> None:
        """``r``'s pages are back: a prefill's answer goes out (its blocks and handoff StateBlock are stored now,
        so the decode worker it names finds them)."""
        if r.answer is not None:
            self.emit(r.answer)

    def _looked_up(self, r: _Running, g: Generation) -> None:
        """On the loop's thread: ``g``'s lookup ended (after its deadline: ``g`` was abandoned, and closed)."""
        if r.generation is g and r.lookup_until is not None:
            r.lookup_until = None
            self.lookups.answered()

    def _expire_lookups(self) -> None:
        now = time.monotonic()
        for r in [r for r in self.running.values() if r.lookup_until is not None and now > r.lookup_until]:
            self._compute_instead(r, f"a lookup took longer than {(self.store_timeout_s or 0) * 1e3:g} ms")

    def _compute_instead(self, r: _Running, why: str) -> None:
        """``r``'s lookup did not end in time: its request waits again, first in line, to run without reuse; the
        abandoned generation's pages come back when its lookup ends."""
        self._end(r)
        self._count_timeout(r.request, why)
        self.waiting.appendleft(r.request)

    def _count_timeout(self, w: _Waiting, why: str) -> None:
        w.reuse = False
        self.store_timeouts += 1
        self.lookups.failed(why)

    def _abort(self, rid: Any) -> None:
        waiting = next((w for w in self.waiting if w.rid == rid), None)
        if waiting is not None:
            self.waiting.remove(waiting)
            if waiting.preempted is not None:
                waiting.preempted.close()
            self.emit({"id": rid, "aborted": True})
        elif rid in self.running:
            self._end(self.running[rid])
            self.emit({"id": rid, "aborted": True})

    def _end(self, r: _Running) -> None:
        """Take ``r`` out and close its generation: its pages come back now, or when the store calls that use
        them end."""
        del self.running[r.rid]
        r.generation.close()

    def _preempted(self, rid: Any) -> None:
        """The scheduler preempted ``rid``: it waits first in line, to resume where it was."""
        r = self.running.pop(rid)
        g = r.generation
        self.waiting.appendleft(_Waiting(rid, r.request.start, r.request.stream, r.request.reuse, g, g.seq.prefill))

    def _step(self) -> None:
        steppable = {rid: r.generation for rid, r in self.running.items() if r.steppable}
        for a in self.scheduler.step(steppable, self._preempted):
            r, g = self.running[a.key], a.generation
            if a.error is not None:  # a bug or a device failure: this request fails, the worker carries on
                self._end(r)
                self.emit({"id": a.key, "error": a.error})
                continue
            if a.token is not None and r.request.stream:
                self.emit({"id": a.key, "token": a.token, **_token_logprobs(g, -1)})
            if g.finish_reason:
                answer = self._answer(r, g)
                if self.role == "prefill":
                    r.answer = answer
                    self._end(r)
                else:
                    self._end(r)
                    self.emit(answer)

    def _answer(self, r: _Running, g: Generation) -> dict[str, Any]:
        seq, rid = g.seq, r.rid
        common: dict[str, Any] = {"hit_tokens": seq.hit_tokens, "replayed": seq.replayed, "ttft_s": seq.ttft_s}
        if not r.request.reuse:
            common["store_timeout"] = True
        if g.sampling.logprobs is not None:
            common["logprobs"] = [[lp, [list(t) for t in top]] for lp, top in g.logprobs]
        if self.role == "prefill":
            first = seq.generated[0] if seq.generated else None
            return {"id": rid, **common, "first_token": first, "finish_reason": g.finish_reason}
        recomputed = len(seq.prompt) - seq.hit_tokens
        answer = {"id": rid, "tokens": seq.generated, "finish_reason": g.finish_reason}
        return {**answer, **common, "recomputed_tokens": recomputed}


def sampling_of(request: dict[str, Any], vocab_size: int) -> Sampling:
    """A request's sampling settings (the protocol's names, :class:`Sampling`'s meanings); ValueError (one line)
    for one out of range."""
    bias = []
    for key, value in (request.get("logit_bias") or {}).items():
        if not 0 <= int(key) < vocab_size:
            raise ValueError(f"logit_bias names token {key}, outside the vocabulary (0…{vocab_size - 1})")
        bias.append((int(key), float(value)))
    logprobs = request.get("logprobs")
    return Sampling(
        temperature=float(request.get("temperature", 0.0)),
        top_p=float(request.get("top_p", 1.0)),
        seed=int(request.get("seed", 0)),
        stop_token_ids=frozenset(int(t) for t in request.get("stop_token_ids", ())),
        top_k=int(request.get("top_k", 0)),
        min_p=float(request.get("min_p", 0.0)),
        logit_bias=tuple(bias),
        presence_penalty=float(request.get("presence_penalty", 0.0)),
        frequency_penalty=float(request.get("frequency_penalty", 0.0)),
        repetition_penalty=float(request.get("repetition_penalty", 1.0)),
        min_tokens=int(request.get("min_tokens", 0)),
        logprobs=None if logprobs is None else int(logprobs),
    )


def _token_logprobs(g: Generation, at: int) -> dict[str, Any]:
    """The protocol's ``logprob`` and ``top_logprobs`` of ``g``'s token ``at``, when it was asked for them."""
    if g.sampling.logprobs is None:
        return {}
    logprob, top = g.logprobs[at]
    return {"logprob": logprob, "top_logprobs": [list(t) for t in top]}


def _say(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(msgspec.json.encode(obj).decode() + "\n")
    out.flush()


class WorkerProcess:
    """The driving side: a child that prints one ready line and then answers one JSON line per request
    (a ``kvtier-engine prefill|decode`` worker; ``kvtier-directory`` also fits for its ready line)."""

    def __init__(
        self, argv: list[str], timeout_s: float = 300.0, stderr: IO[bytes] | None = None, with_parent: bool = False
    ) -> None:
        """Start ``argv``; its stderr goes to ``stderr`` (a file), else to this process's. ``with_parent``: the
        child is sent SIGTERM when the thread that starts it ends (:mod:`kvtier.kvstore.cluster.children`; for a child
        that never reads its stdin, so would not notice its parent is gone)."""
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
            preexec_fn=die_with_parent if with_parent else None,
        )  # fmt: skip
        self.ready: Any = None
        self.timeout_s = timeout_s  # for each answer (and the ready line)

    @classmethod
    def engine(cls, role: str, *args: str) -> WorkerProcess:
        return cls([sys.executable, "-m", "kvtier.engine.cli", role, *args])

    def wait_ready(self) -> WorkerProcess:
        """Read the ready line (JSON, or the raw text of a non-JSON one); RuntimeError if the child exited."""
        self.ready = self._read()
        return self

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        """End of input (a worker exits when its stdin closes), then terminate whatever is still running."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], self.timeout_s)[0]:
            raise TimeoutError(f"{self.proc.args[3:5]} did not answer within {self.timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args[3:5]} exited with status {self.proc.wait()}")
        return json.loads(line) if line.startswith("{") else line.strip()
