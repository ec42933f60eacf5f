"""The server's side of its engine workers: one handle per worker, whatever runs it.

- :class:`ThreadWorker`: the embedded default; the engine's :class:`~kvtier.engine.worker.WorkerLoop` on a thread of
  the server process.
- :class:`ProcessWorker`: a ``prefill`` or ``decode`` worker process (JSON lines on its stdin/stdout), supervised:
  when it exits, every request it held fails with one error event and it is started again (back-off from 1 s
  to 30 s); ``ready`` is False from the exit until its ready line.

Both are used the same way from the server's event loop: ``async for event in worker.events(request)`` yields
the worker's lines for that request's id (tokens, then one final answer, error or aborted line) and aborts the
request on the worker if the consumer stops early (a client gone, a stop string, an error elsewhere).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import json
import logging
import queue
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from kvtier.engine.engine import Engine
from kvtier.engine.scheduler import StepCost
from kvtier.engine.worker import WorkerLoop, remove_leftovers

log = logging.getLogger("kvtier.serving")
FINAL = ("error", "aborted", "tokens", "first_token")  # keys of a request's last line


def is_final(event: dict[str, Any]) -> bool:
    return any(k in event for k in FINAL)


class Worker(abc.ABC):
    """A handle to one engine worker; ``running`` maps each request id it holds to that request's KV tokens
    (what the decode balancer weighs). Events are delivered from the worker's thread onto the server's loop."""

    _ids = itertools.count()

    def __init__(self, role: str, name: str) -> None:
        self.role, self.name = role, name
        self.ready = False
        self.running: dict[str, int] = {}
        self.restarts = 0
        self.on_ready: Callable[[], None] | None = None  # called on the server's loop whenever it becomes ready
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def events(self, request: dict[str, Any], kv_tokens: int = 0) -> AsyncIterator[dict[str, Any]]:
        """Send ``request`` (its ``id`` is set here) and yield its events up to and including the final one.
        Closing the iterator before that aborts the request on the worker."""
        rid = request["id"] = f"{self.name}-{next(self._ids)}"
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[rid] = q
        self.running[rid] = kv_tokens
        finished = False
        try:
            if not self.ready:
                finished = True
                yield {"id": rid, "error": f"{self.name} is not running"}
                return
            self._send(request)
            while True:
                event = await q.get()
                if "token" in event:
                    self.running[rid] = self.running.get(rid, 0) + 1
                finished = is_final(event)
                yield event
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self.running.pop(rid, None)
            if not finished and self.ready:
                self._send({"abort": rid})

    def _set_ready(self, ready: bool) -> None:
        """On the loop: the worker is up (or not); an ``on_ready`` callback is told when it comes up."""
        self.ready = ready
        if ready and self.on_ready is not None:
            self.on_ready()

    def _deliver(self, event: dict[str, Any]) -> None:
        """From any thread: hand ``event`` to the request it names."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._route, event)

    def _route(self, event: dict[str, Any]) -> None:
        q = self._queues.get(event.get("id"))  # type: ignore[arg-type]
        if q is not None:
            q.put_nowait(event)

    def _fail_all(self, message: str) -> None:
        """On the loop: every request this worker held ends with an error event."""
        for rid, q in list(self._queues.items()):
            q.put_nowait({"id": rid, "error": message})

    @abc.abstractmethod
    def _send(self, obj: dict[str, Any]) -> None:
        """Hand ``obj`` (a request or an abort) to the worker: its thread's inbox or its process's stdin."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the worker and wait for it (it takes no more requests)."""


class ThreadWorker(Worker):
    """The engine in this process: ``open_engine()`` (called on the worker's thread, so the server answers
    ``/health`` while the model loads), then a :class:`WorkerLoop` (role ``both``) on that thread."""

    def __init__(
        self,
        open_engine: Callable[[], Engine],
        cost: StepCost | None = None,
        step_budget_s: float = 0.0,
        name: str = "engine",
        loop_options: dict[str, Any] | None = None,
    ) -> None:
        """``loop_options``: the :class:`WorkerLoop`'s keyword arguments (``store_timeout_s``, ``max_running``)."""
        super().__init__("both", name)
        self.open_engine, self.cost, self.step_budget_s = open_engine, cost, step_budget_s
        self.loop_options = loop_options or {}
        self.loop: WorkerLoop | None = None
        self._inbox: queue.Queue[str | dict[str, Any] | None] = queue.Queue()  # the loop's, made before it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    async def start(self) -> None:
        await super().start()
        self._thread.start()

    def _run(self) -> None:
        try:
            engine = self.open_engine()
        except Exception as e:
            log.error("%s did not load: %s", self.name, e)
            return
        with engine:
            self.loop = WorkerLoop(
                engine, "both", self._deliver, self.cost, self.step_budget_s, self._inbox, **self.loop_options
            )
            assert self._loop is not None
            log.info("%s is ready", self.name)
            self._loop.call_soon_threadsafe(self._set_ready, True)
            self.loop.run()

    def _send(self, obj: dict[str, Any]) -> None:
        self._inbox.put(obj)

    def stop(self) -> None:
        self.ready = False
        self._inbox.put(None)
        self._thread.join(timeout=60)


class ProcessWorker(Worker):
    """A supervised worker process started with ``argv`` (a ``prefill`` or ``decode`` worker command)."""

    def __init__(self, role: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        """``env``: the process's environment (default this one's)."""
        super().__init__(role, name)
        self.argv, self.env = argv, env
        self.proc: subprocess.Popen[str] | None = None
        self._stopping = False
        self._outbox: queue.Queue[str | None] = queue.Queue()
        self._supervisor = threading.Thread(target=self._supervise, name=f"{name}-supervisor", daemon=True)

    async def start(self) -> None:
        await super().start()
        self._supervisor.start()

    def _send(self, obj: dict[str, Any]) -> None:
        self._outbox.put(msgspec.json.encode(obj).decode())  # (json.dumps: 10x the time for 77K token ids)

    def _supervise(self) -> None:
        backoff = 1.0
        while not self._stopping:
            began = time.monotonic()
            proc = self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=self.env
            )
            outbox = self._outbox = queue.Queue()  # lines for this process only
            writer = threading.Thread(target=self._write, args=(proc, outbox), daemon=True)
            writer.start()
            assert proc.stdout is not None
            for line in proc.stdout:
                event = json.loads(line) if line.startswith("{") else {}
                if event.get("ready"):
                    log.info("%s is ready (pid %d)", self.name, proc.pid)
                    self._ready_from_thread(True)
                elif "id" in event:
                    self._deliver(event)
            status = proc.wait()
            remove_leftovers(self.role, proc.pid)  # a killed worker's StateBlock pool
            outbox.put(None)  # ends this process's writer
            writer.join()
            self._ready_from_thread(False)
            if self._stopping:
                return
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all, f"{self.name} exited with status {status}")
            self.restarts += 1
            backoff = 1.0 if time.monotonic() - began > 60 else min(backoff * 2, 30.0)
            held = len(self._queues)
            log.warning(
                "%s exited with status %s (%d requests failed); restarting it in %g s", self.name, status, held, backoff
            )
            time.sleep(backoff)
            log.info("%s is restarting (restart %d)", self.name, self.restarts)

    def _ready_from_thread(self, ready: bool) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._set_ready, ready)

    @staticmethod
    def _write(proc: subprocess.Popen[str], outbox: queue.Queue[str | None]) -> None:
        assert proc.stdin is not None
        while (line := outbox.get()) is not None:
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # the process died; the supervisor sees it
                return

    def stop(self) -> None:
        """End the worker (end of its input; SIGTERM after 10 s, SIGKILL 10 s later) and stop supervising it."""
        self._stopping = True
        self.ready = False
        proc = self.proc
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError, ValueError):
                    proc.stdin.close()
            for signal_it in (lambda: None, proc.terminate, proc.kill):
                signal_it()
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._supervisor.join(timeout=30)
