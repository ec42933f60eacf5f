"""The put/get benchmark's phases, for any store: warm-up, fill, put, get (and a degraded get), run by one
worker thread per :class:`Session`; see ``kvbench putget --help`` and :func:`run_putget`."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.kvstore.codec import shard_size
from kvtier.tools.benchutil import busy_seconds, latency_percentiles
from kvtier.tools.kvbench.common import BenchError, ProgressView, VerifyError

KEY_BYTES = 16
STAMP_STRIDE = 4096


@dataclass(frozen=True)
class Spec:
    block_size: int
    blocks_per_call: int
    concurrency: int
    duration_s: float
    max_bytes: int
    fill: bool = True

    @property
    def batch_bytes(self) -> int:
        return self.block_size * self.blocks_per_call

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "batch_bytes": self.batch_bytes,
            "blocks_per_call": self.blocks_per_call,
            "concurrency": self.concurrency,
            "duration_s": self.duration_s,
            "max_bytes": self.max_bytes,
            "fill": self.fill,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Spec:
        return cls(d["block_size"], d["blocks_per_call"], d["concurrency"], d["duration_s"], d["max_bytes"], d["fill"])


# --- sessions: one store connection per worker thread ---------------------------------------------------------


class Session(ABC):
    """One worker's connection to a store. ``attach`` is called once, serially, before any timed call."""

    poison_destination = True  # get writes into ``dst``: clear it before each get so stale bytes cannot pass
    settle_s = 0.0  # after deletes, how long until the store reuses the freed space

    def attach(self, src: bytearray, dst: bytearray, spec: Spec) -> None:
        self.src, self.dst, self.spec = src, dst, spec

    @abstractmethod
    def put(self, keys: list[bytes]) -> None:
        """Store the blocks of ``src`` under ``keys``."""

    @abstractmethod
    def get(self, keys: list[bytes]) -> list[bool]:
        """Read ``keys`` into ``dst``; per key whether it was found."""

    def verify(self, keys: list[bytes]) -> int:
        """Index of the first block whose bytes differ from what was put, or -1."""
        if self.dst == self.src:
            return -1
        return _first_mismatch(memoryview(self.dst), memoryview(self.src), self.spec.block_size)

    @abstractmethod
    def delete(self, keys: list[bytes]) -> None:
        """Remove ``keys`` (best effort)."""

    def close(self) -> None:  # noqa: B027 - most stores have nothing to release
        """Release the connection (nothing to do by default)."""


def _first_mismatch(got: memoryview, want: memoryview, block_size: int) -> int:
    a = np.frombuffer(got, dtype=np.uint8).reshape(-1, block_size)
    b = np.frombuffer(want, dtype=np.uint8).reshape(-1, block_size)
    bad = np.flatnonzero((a != b).any(axis=1))
    return int(bad[0]) if len(bad) else -1


def block_views(buf: bytearray, block_size: int) -> list[memoryview]:
    view = memoryview(buf)
    return [view[i : i + block_size] for i in range(0, len(buf), block_size)]


# --- the phases ---------------------------------------------------------------------------------------------------


class Budget:
    """Bytes the run may still store, shared by the workers."""

    def __init__(self, limit: int) -> None:
        self.left = limit
        self.exhausted = False
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self.left:
                self.exhausted = True
                return False
            self.left -= n
            return True


@dataclass
class Calls:
    """Timed calls of one worker in one phase."""

    intervals: list[tuple[float, float]] = field(default_factory=list)
    bytes: int = 0
    blocks: int = 0


class Worker:
    """One thread's buffers, session and the batches it stored."""

    def __init__(self, index: int, session: Session, spec: Spec) -> None:
        self.index = index
        self.session = session
        self.spec = spec
        rng = np.random.default_rng(index)
        self.src = bytearray(rng.bytes(spec.batch_bytes))
        self.dst = bytearray(b"\xa5" * spec.batch_bytes)  # written once now, so no first touch during a get
        self._src_blocks = np.frombuffer(self.src, dtype=np.uint8).reshape(spec.blocks_per_call, spec.block_size)
        stride = max(KEY_BYTES, min(STAMP_STRIDE, shard_size(spec.block_size)))
        starts = np.arange(0, spec.block_size - KEY_BYTES + 1, stride)
        self._stamp_at = starts[:, None] + np.arange(KEY_BYTES)[None, :]
        self.batches: list[list[bytes]] = []  # stored by the put phase, in order
        self.fill_batches: list[list[bytes]] = []  # stored by the fill pass and not deleted yet
        self.warm_keys: list[bytes] = []
        self.calls: dict[str, Calls] = {}

    def new_keys(self) -> list[bytes]:
        raw = os.urandom(KEY_BYTES * self.spec.blocks_per_call)
        return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]

    def stamp(self, keys: list[bytes]) -> None:
        """Write each block's key into it every STAMP_STRIDE bytes: what a later read of that key must return."""
        stamps = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), KEY_BYTES)
        self._src_blocks[:, self._stamp_at] = stamps[:, None, :]

    def put_batch(self, keys: list[bytes], calls: Calls | None) -> None:
        self.stamp(keys)
        start = time.perf_counter()
        self.session.put(keys)
        end = time.perf_counter()
        if calls is not None:
            calls.intervals.append((start, end))
            calls.bytes += self.spec.batch_bytes
            calls.blocks += len(keys)

    def get_batch(self, keys: list[bytes], calls: Calls | None, system: str, phase: str) -> None:
        self.stamp(keys)
        if self.session.poison_destination:
            ctypes.memset(ctypes.addressof((ctypes.c_char * len(self.dst)).from_buffer(self.dst)), 0, len(self.dst))
        start = time.perf_counter()
        found = self.session.get(keys)
        end = time.perf_counter()
        if calls is not None:
            calls.intervals.append((start, end))
            calls.bytes += self.spec.batch_bytes
            calls.blocks += len(keys)
        if not all(found):
            misses = [k.hex() for k, ok in zip(keys, found, strict=True) if not ok]
            raise VerifyError(
                f"{system} {phase}: {len(misses)} of {len(keys)} blocks of a batch were not found (first: {misses[0]})"
            )
        bad = self.session.verify(keys)
        if bad >= 0:
            raise VerifyError(f"{system} {phase}: block {keys[bad].hex()} came back with wrong bytes")


def _run_workers(
    workers: list[Worker], body: Callable[[Worker], None], tick: Callable[[], None], stop: threading.Event
) -> float:
    """Run ``body(worker)`` in one thread per worker, started together; returns the wall time. Re-raises the
    first worker error; ``tick`` runs about ten times a second meanwhile."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(workers) + 1)

    def run(worker: Worker) -> None:
        barrier.wait()
        try:
            body(worker)
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(w,), daemon=True, name=f"kvbench-{w.index}") for w in workers]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.1)
                tick()
    except BaseException:
        stop.set()
        raise
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall


def phase_summary(calls: list[Calls], wall: float) -> dict[str, Any]:
    intervals = [iv for c in calls for iv in c.intervals]
    busy = busy_seconds(intervals)
    total_bytes = sum(c.bytes for c in calls)
    blocks = sum(c.blocks for c in calls)
    return {
        "bytes": total_bytes,
        "blocks": blocks,
        "calls": len(intervals),
        "busy_s": busy,
        "wall_s": wall,
        "gbps": total_bytes / busy / 1e9 if busy > 0 else 0.0,
        "blocks_per_s": blocks / busy if busy > 0 else 0.0,
        "ratio_to_raw": None,
        "latency_ms": latency_percentiles(end - start for start, end in intervals),
    }


def run_putget(
    system: str,
    sessions: Sequence[Session],
    spec: Spec,
    progress: ProgressView,
    degrade: Callable[[], None] | None = None,
    keep: list[Worker] | None = None,
) -> tuple[dict[str, Any], list[Worker]]:
    """Warm-up, fill, put phase, get phase (and a degraded get phase after ``degrade()``); see the module doc.

    ``keep``, when given, receives the workers at once, so that a caller can delete what they stored even when
    the run fails."""
    workers = [Worker(i, s, spec) for i, s in enumerate(sessions)]
    if keep is not None:
        keep.extend(workers)
    for w in workers:
        w.session.attach(w.src, w.dst, spec)
    budget = Budget(spec.max_bytes)
    stop = threading.Event()

    def warm(w: Worker) -> None:
        if not budget.take(spec.batch_bytes):
            raise BenchError("--max-bytes is too small for the warm-up")
        keys = w.new_keys()
        w.warm_keys = keys
        w.put_batch(keys, None)
        w.get_batch(keys, None, system, "warm-up get")

    _run_workers(workers, warm, lambda: None, stop)
    if spec.fill:
        _fill(system, workers, spec, progress, stop)

    label = f"{system} put"
    progress.start(label, spec.duration_s)
    deadline = time.perf_counter() + spec.duration_s
    started = time.perf_counter()

    def put(w: Worker) -> None:
        calls = w.calls["put"] = Calls()
        while not stop.is_set() and time.perf_counter() < deadline:
            if not budget.take(spec.batch_bytes):
                return
            keys = w.new_keys()
            w.batches.append(keys)  # before the put: a failed put's blocks are deleted too (--config)
            w.put_batch(keys, calls)

    wall = _run_workers(workers, put, lambda: progress.update(label, time.perf_counter() - started), stop)
    progress.finish(label)
    result = {"put": phase_summary([w.calls["put"] for w in workers], wall)}
    result["put"]["stopped_by"] = "max_bytes" if budget.exhausted else "duration"
    if not result["put"]["calls"]:
        raise BenchError(f"{system}: the put phase completed no call in {spec.duration_s:g} s; raise --duration")

    phases = ["get"] + (["get_degraded"] if degrade is not None else [])
    for phase in phases:
        if phase == "get_degraded":
            assert degrade is not None
            degrade()
        label = f"{system} {phase.replace('_', ' ')}"
        total = sum(len(w.batches) for w in workers) * spec.batch_bytes
        progress.start(label, total)

        def get(w: Worker, phase: str = phase) -> None:
            calls = w.calls[phase] = Calls()
            for keys in w.batches:
                if stop.is_set():
                    return
                w.get_batch(keys, calls, system, phase.replace("_", " "))

        wall = _run_workers(
            workers, get, lambda label=label, phase=phase: progress.update(label, _done(workers, phase)), stop
        )
        progress.finish(label)
        result[phase] = phase_summary([w.calls[phase] for w in workers], wall)
    return result, workers


def _fill(system: str, workers: list[Worker], spec: Spec, progress: ProgressView, stop: threading.Event) -> None:
    """Untimed: put for the phase's duration, delete it all, let the store settle. The timed puts then land in
    space the store has used and freed before, as they do in a cache that runs full (its steady state)."""
    budget = Budget(spec.max_bytes - len(workers) * spec.batch_bytes)  # the warm-up batches stay stored
    label = f"{system} fill (untimed)"
    progress.start(label, spec.duration_s)
    started = time.perf_counter()
    deadline = started + spec.duration_s

    def fill(w: Worker) -> None:
        while not stop.is_set() and time.perf_counter() < deadline and budget.take(spec.batch_bytes):
            keys = w.new_keys()
            w.fill_batches.append(keys)
            w.put_batch(keys, None)

    def drop(w: Worker) -> None:
        while w.fill_batches:
            w.session.delete(w.fill_batches[-1])
            w.fill_batches.pop()

    _run_workers(workers, fill, lambda: progress.update(label, time.perf_counter() - started), stop)
    _run_workers(workers, drop, lambda: None, stop)
    progress.finish(label)
    time.sleep(max(w.session.settle_s for w in workers))


def _done(workers: list[Worker], phase: str) -> int:
    return sum(w.calls[phase].bytes for w in workers if phase in w.calls)


def with_raw(result: dict[str, Any], raw_gbps: float) -> dict[str, Any]:
    result["raw_stream_gbps"] = raw_gbps
    for phase in ("put", "get", "get_degraded", "get_alloc"):
        if phase in result:
            result[phase]["ratio_to_raw"] = result[phase]["gbps"] / raw_gbps if raw_gbps > 0 else None
    return result


def verified_blocks(result: dict[str, Any]) -> int:
    return sum(result[p]["blocks"] for p in ("get", "get_degraded", "get_alloc") if p in result)
