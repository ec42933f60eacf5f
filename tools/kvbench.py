"""``kvbench``: kvtier's benchmark tool. Put/get throughput and latency against a real cluster, optionally next to
Redis and Mooncake Store on the same machine, every figure also as a ratio to one raw loopback TCP stream of the
same bytes measured in the same run; and ``replay`` of request traces.

    kvbench [--config PATH] putget [--block-size SIZE] [--concurrency N] [--duration S] [--batch-bytes SIZE]
                                   [--max-bytes SIZE] [--fresh] [--vs-redis] [--vs-mooncake] [--degraded K]
                                   [--json]
    kvbench replay TRACE [replay options]          (see ``kvbench replay --help``)

**putget.** Without ``--config`` kvbench starts a temporary local 12-node cluster (real node processes) and stops
and removes it at the end; with ``--config`` it uses the running cluster that file describes (and deletes the
blocks it wrote when done). ``N`` worker threads, one client each, run:

1. *warm-up*: one batched put and get per worker, verified, not timed;
2. *fill* (untimed; ``--fresh`` skips it): the workers put for ``--duration`` seconds, delete it all and wait for
   the store to reuse the space (the temporary cluster's ``[gc] grace_s`` is 0.5 s). The timed puts then land in
   space the store has used and freed before, as in a cache that runs full, not in never-touched memory or file
   space (whose first-touch costs dominate a short run);
3. *put phase*: each worker loops batched puts (``put_from``, views of a preallocated buffer) of fresh random
   16-byte keys, ``--batch-bytes`` per call, for ``--duration`` seconds across the workers, or until ``--max-bytes``
   are stored (warm-up included; a cap that keeps Redis's and Mooncake's memory and the cluster's capacity
   bounded: ``stopped_by`` says which ended the phase);
4. *get phase*: each worker reads back every batch it stored, once, with ``get_into`` into a preallocated buffer,
   and checks every byte (each block carries its key every 4 KiB, or at least once per erasure-code shard); a
   miss or a wrong byte stops kvbench with ``DATA MISMATCH`` and exit status 1;
5. with ``--degraded K`` (1 or 2; only on the temporary cluster): SIGKILL ``K`` nodes, then the get phase again.

Throughput is bytes over *busy time*: the time during which at least one call was in flight (key stamping and
verification between calls are not counted). Latencies are per call (one call moves one batch), nearest-rank
percentiles. Redis (``--vs-redis``: Debian ``redis-server`` on a free loopback port, no persistence, redis-py,
pipelined SET and MGET of the same batches) and Mooncake Store (``--vs-mooncake``: ``mooncake_master`` with its
HTTP metadata server, one store-server process holding the segment, protocol tcp on loopback, zero-copy
``batch_put_from`` / ``batch_get_into`` on registered buffers, client in its own process) run the same phases one
after another, never at the same time.

``--json`` prints one object::

    {"command": "putget",
     "settings": {"block_size", "batch_bytes", "blocks_per_call", "concurrency", "duration_s", "max_bytes",
                  "fill", "degraded"},
     "cluster": {"kind": "temporary" | "config", "path", "nodes", "codec_backend", "killed_nodes"},
     "kvtier":   {"raw_stream_gbps", "put": PHASE, "get": PHASE, "get_degraded": PHASE (with --degraded)},
     "redis":    {"raw_stream_gbps", "version", "put": PHASE, "get": PHASE}          (with --vs-redis)
     "mooncake": {"raw_stream_gbps", "version", "put": PHASE, "get": PHASE}          (with --vs-mooncake)
     "verified_blocks": every block read back and checked, all systems and get phases}

    PHASE = {"bytes", "blocks", "calls", "busy_s", "wall_s", "gbps", "blocks_per_s", "ratio_to_raw",
             "latency_ms": {"p50", "p99", "p999"}, "stopped_by": "duration" | "max_bytes" (put only)}

Exit status: 0; 1 when a read came back wrong or missing, or a store failed; 2, with one ``kvbench: error:``
line on stderr, for a bad option, a missing or unreachable cluster, or a missing Redis or Mooncake.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.client import CapacityError, Client
from kvtier.kvstore.codec import DATA_SHARDS, PARITY_SHARDS, shard_size
from kvtier.kvstore.local import LocalCluster
from kvtier.kvstore.slabs import MAX_SHARD_BYTES
from kvtier.kvstore.transport import AuthError
from kvtier.kvstore.units import format_size, parse_duration, parse_size
from kvtier.tools.benchutil import busy_seconds, free_port, latency_percentiles, raw_stream_gbps, temp_cluster
from kvtier.tools.replay import add_replay_arguments, run_replay

PROG = "kvbench"
KEY_BYTES = 16
STAMP_STRIDE = 4096
MAX_BLOCKS_PER_CALL = 16384
MAX_CONCURRENCY = 64
MAX_BLOCK_BYTES = DATA_SHARDS * MAX_SHARD_BYTES
SHOW_PROGRESS_AFTER_S = 2.0
MOONCAKE_DIST = "mooncake-transfer-engine-non-cuda"
SERVICE_START_TIMEOUT_S = 60.0
GRACE_S = 0.5  # [gc] grace_s of the temporary cluster: deleted blocks' slots are reused soon (steady state)


class UsageError(Exception):
    """Something the user can fix (an option, a cluster file, a missing program); one line, exit status 2."""


class BenchError(Exception):
    """A run that failed (a store refused or broke); one line, exit status 1."""


class VerifyError(BenchError):
    """A read came back missing or with wrong bytes."""


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


# --- progress ---------------------------------------------------------------------------------------------------


class ProgressView:
    """Progress of the running phase. This base class shows nothing (``--json``, or stderr not a terminal)."""

    def start(self, label: str, total: float) -> None:
        pass

    def update(self, label: str, completed: float) -> None:
        pass

    def finish(self, label: str) -> None:
        pass

    def close(self) -> None:
        pass


class RichProgress(ProgressView):
    """rich bars on stderr, shown once a phase has run for a couple of seconds, removed when it ends."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._progress.start()
        self._tasks: dict[str, tuple[Any, float]] = {}

    def start(self, label: str, total: float) -> None:
        task = self._progress.add_task(label, total=max(total, 1e-9), visible=False)
        self._tasks[label] = (task, time.monotonic())

    def update(self, label: str, completed: float) -> None:
        if label not in self._tasks:
            return
        task, started = self._tasks[label]
        visible = time.monotonic() - started >= SHOW_PROGRESS_AFTER_S
        self._progress.update(task, completed=completed, visible=visible)

    def finish(self, label: str) -> None:
        if label in self._tasks:
            task, _ = self._tasks.pop(label)
            self._progress.remove_task(task)

    def close(self) -> None:
        self._progress.stop()


class JsonLinesProgress(ProgressView):
    """Progress as JSON lines on stdout: how a benchmark child process reports to kvbench."""

    def _emit(self, **fields: Any) -> None:
        print(json.dumps({"progress": fields}), flush=True)

    def start(self, label: str, total: float) -> None:
        self._emit(event="start", label=label, total=total)

    def update(self, label: str, completed: float) -> None:
        self._emit(event="update", label=label, completed=completed)

    def finish(self, label: str) -> None:
        self._emit(event="finish", label=label)


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


def _block_views(buf: bytearray, block_size: int) -> list[memoryview]:
    view = memoryview(buf)
    return [view[i : i + block_size] for i in range(0, len(buf), block_size)]


class KvtierSession(Session):
    def __init__(self, config: cluster_mod.ClusterConfig) -> None:
        self.client = Client(config)
        self.settle_s = config.gc.grace_s + 0.5  # a deleted block's slots are reused after the grace time

    def attach(self, src: bytearray, dst: bytearray, spec: Spec) -> None:
        super().attach(src, dst, spec)
        self.src_views = _block_views(src, spec.block_size)
        self.dst_views = _block_views(dst, spec.block_size)

    def put(self, keys: list[bytes]) -> None:
        try:
            stored = self.client.put_from(keys, self.src_views)
        except CapacityError as exc:
            raise BenchError(f"kvtier: {exc}; lower --max-bytes or give the nodes more capacity") from None
        if not all(stored):
            missing = len(stored) - sum(stored)
            raise BenchError(
                f"kvtier stored only {len(stored) - missing} of {len(stored)} blocks of a put (nodes down or failing?)"
            )

    def get(self, keys: list[bytes]) -> list[bool]:
        return self.client.get_into(keys, self.dst_views)

    def delete(self, keys: list[bytes]) -> None:
        self.client.delete(keys)

    def close(self) -> None:
        self.client.close()


class RedisSession(Session):
    """Blocks as plain Redis values: pipelined SET, one MGET per batch (redis-py)."""

    poison_destination = False  # MGET returns new bytes objects; verify compares those

    def __init__(self, port: int) -> None:
        import redis

        self.redis = redis.Redis(host="127.0.0.1", port=port, socket_timeout=300, socket_connect_timeout=10)
        self._values: list[bytes | None] = []

    def attach(self, src: bytearray, dst: bytearray, spec: Spec) -> None:
        super().attach(src, dst, spec)
        self.src_views = _block_views(src, spec.block_size)

    def put(self, keys: list[bytes]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for key, view in zip(keys, self.src_views, strict=True):
            pipe.set(key, view)
        replies = pipe.execute()
        if not all(replies):
            raise BenchError(f"redis refused {sum(not r for r in replies)} of {len(keys)} SETs")

    def get(self, keys: list[bytes]) -> list[bool]:
        self._values = self.redis.mget(keys)
        return [v is not None for v in self._values]

    def delete(self, keys: list[bytes]) -> None:
        self.redis.delete(*keys)

    def verify(self, keys: list[bytes]) -> int:
        values = self._values
        self._values = []
        if all(v is not None and len(v) == self.spec.block_size for v in values) and b"".join(values) == self.src:
            return -1
        for i, (value, view) in enumerate(zip(values, self.src_views, strict=True)):
            if value != view:
                return i
        return -1

    def close(self) -> None:
        self.redis.close()


class MooncakeSession(Session):
    """Zero-copy Mooncake Store calls on buffers registered with the (shared, thread-safe) store object."""

    def __init__(self, store: Any, lock: threading.Lock) -> None:
        self.store = store
        self.lock = lock
        self._registered: list[int] = []

    def attach(self, src: bytearray, dst: bytearray, spec: Spec) -> None:
        super().attach(src, dst, spec)
        addresses = []
        for buf in (src, dst):
            address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
            with self.lock:
                rc = self.store.register_buffer(address, len(buf))
            if rc != 0:
                raise BenchError(f"mooncake register_buffer of {len(buf)} bytes returned {rc}")
            self._registered.append(address)
            addresses.append(address)
        n, size = spec.blocks_per_call, spec.block_size
        self.src_ptrs = [addresses[0] + i * size for i in range(n)]
        self.dst_ptrs = [addresses[1] + i * size for i in range(n)]
        self.sizes = [size] * n

    def put(self, keys: list[bytes]) -> None:
        codes = self.store.batch_put_from([k.hex() for k in keys], self.src_ptrs, self.sizes)
        failed = [c for c in codes if c != 0]
        if failed:
            raise BenchError(f"mooncake batch_put_from failed for {len(failed)} of {len(keys)} keys (code {failed[0]})")

    def get(self, keys: list[bytes]) -> list[bool]:
        got = self.store.batch_get_into([k.hex() for k in keys], self.dst_ptrs, self.sizes)
        return [n == self.spec.block_size for n in got]

    def delete(self, keys: list[bytes]) -> None:
        codes = self.store.batch_remove([k.hex() for k in keys], True)  # force: no wait for the read lease
        failed = [c for c in codes if c != 0]
        if failed:
            raise BenchError(f"mooncake batch_remove failed for {len(failed)} of {len(keys)} keys (code {failed[0]})")

    def close(self) -> None:
        with self.lock:
            for address in self._registered:
                self.store.unregister_buffer(address)
        self._registered.clear()


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


def _phase_summary(calls: list[Calls], wall: float) -> dict[str, Any]:
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
    result = {"put": _phase_summary([w.calls["put"] for w in workers], wall)}
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
        result[phase] = _phase_summary([w.calls[phase] for w in workers], wall)
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


def _with_raw(result: dict[str, Any], raw_gbps: float) -> dict[str, Any]:
    result["raw_stream_gbps"] = raw_gbps
    for phase in ("put", "get", "get_degraded"):
        if phase in result:
            result[phase]["ratio_to_raw"] = result[phase]["gbps"] / raw_gbps if raw_gbps > 0 else None
    return result


def _verified(result: dict[str, Any]) -> int:
    return sum(result[p]["blocks"] for p in ("get", "get_degraded") if p in result)


# --- kvtier -------------------------------------------------------------------------------------------------------


def _probe_cluster(config: cluster_mod.ClusterConfig, path: str) -> list[str]:
    """Check that the cluster answers and stores a block; returns warnings about unreachable nodes."""
    down = []
    for nid, node in sorted(config.nodes.items()):
        try:
            with socket.create_connection((node.host, node.port), timeout=config.client.connect_timeout_s):
                pass
        except OSError as exc:
            down.append(f"node {nid} at {node.host}:{node.port}: {exc.strerror or exc}")
    if len(down) == len(config.nodes):
        raise UsageError(f"cannot reach the cluster of {path}: no node answers ({down[0]}); is it running?")
    key = os.urandom(KEY_BYTES)
    try:
        with Client(config) as client:
            stored = client.put([key], [b"kvbench probe"])[0]
            if stored:
                client.delete([key])
    except AuthError as exc:
        raise UsageError(f"the cluster of {path} rejected its token: {exc}") from None
    if not stored:
        detail = f": {len(down)} of {len(config.nodes)} nodes unreachable ({'; '.join(down[:3])})" if down else ""
        raise UsageError(f"the cluster of {path} does not accept writes{detail}")
    return [f"warning: {d}" for d in down]


def run_kvtier(args: argparse.Namespace, spec: Spec, progress: ProgressView) -> tuple[dict[str, Any], dict[str, Any]]:
    """The kvtier run; returns (its result, the cluster description)."""
    if args.config is not None:
        try:
            config = cluster_mod.load(args.config)
        except cluster_mod.ConfigError as exc:
            raise UsageError(str(exc)) from None
        for warning in _probe_cluster(config, args.config):
            print(f"{PROG}: {warning}", file=sys.stderr)
        # keep well under the GC's low watermark, so nothing of ours is evicted before it is read back
        room = int(sum(n.capacity_bytes for n in config.nodes.values()) * config.gc.low_watermark * 0.5)
        room = room * DATA_SHARDS // (DATA_SHARDS + PARITY_SHARDS)
        run_spec = Spec(
            spec.block_size,
            spec.blocks_per_call,
            spec.concurrency,
            spec.duration_s,
            min(spec.max_bytes, room),
            spec.fill,
        )
        if run_spec.max_bytes < 2 * spec.concurrency * spec.batch_bytes:
            raise UsageError(f"the cluster of {args.config} is too small for {spec.concurrency} x 2 batches")
        sessions = [KvtierSession(config) for _ in range(spec.concurrency)]
        workers: list[Worker] = []
        try:
            result, _ = run_putget("kvtier", sessions, run_spec, progress, keep=workers)
        finally:
            _cleanup(sessions, workers)
        cluster = {
            "kind": "config",
            "path": str(Path(args.config).resolve()),
            "nodes": len(config.nodes),
            "codec_backend": sessions[0].client.codec.backend,
            "killed_nodes": [],
        }
    else:
        # each node holds about a tenth of the data plus parity and slot slack; stay far below the watermarks
        capacity = max(1 << 30, -(-spec.max_bytes * 2 // 10 // (1 << 20)) << 20)
        killed: list[int] = []
        with temp_cluster(12, capacity, grace_s=GRACE_S, prefix="kvbench-") as local:
            sessions = [KvtierSession(local.config) for _ in range(spec.concurrency)]

            def degrade() -> None:
                victims = sorted(random.sample(local.local_ids, args.degraded))
                for nid in victims:
                    local.kill(nid, signal.SIGKILL)
                killed.extend(victims)

            try:
                result, _ = run_putget("kvtier", sessions, spec, progress, degrade if args.degraded else None)
            except BenchError as exc:
                raise type(exc)(f"{exc}{_node_trouble(local, killed)}") from None
            finally:
                for s in sessions:
                    s.close()
            cluster = {
                "kind": "temporary",
                "path": None,
                "nodes": len(local.config.nodes),
                "codec_backend": sessions[0].client.codec.backend,
                "killed_nodes": killed,
            }
    return _with_raw(result, raw_stream_gbps(result["put"]["bytes"])), cluster


def _node_trouble(local: LocalCluster, killed: list[int]) -> str:
    """What the temporary cluster's node logs say, to explain a failed run (nodes normally log nothing)."""
    notes = []
    for nid in local.local_ids:
        if nid in killed:
            continue
        proc = local.procs.get(nid)
        exited = proc is None or proc.poll() is not None
        log = local.log_path(nid)
        said = log.exists() and log.stat().st_size > 0
        if exited or said:
            state = f"exited with code {proc.returncode if proc else '?'}" if exited else "running"
            notes.append(f"node {nid} {state}: {_last_line(log) if said else 'no log'}")
    return f" [{'; '.join(notes[:3])}{'; ...' if len(notes) > 3 else ''}]" if notes else ""


def _cleanup(sessions: Sequence[KvtierSession], workers: list[Worker]) -> None:
    """Delete what the run wrote to a user's cluster (best effort), then close the clients."""
    try:
        for w in workers:
            for keys in [w.warm_keys, *w.fill_batches, *w.batches]:
                if keys:
                    w.session.delete(keys)
    except Exception as exc:  # a node gone mid-run: its GC reclaims what is left
        print(f"{PROG}: warning: could not delete every benchmark block: {exc}", file=sys.stderr)
    finally:
        for s in sessions:
            s.close()


# --- child processes ----------------------------------------------------------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Have the child receive SIGTERM when kvbench dies, so no server outlives it."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _last_line(path: Path) -> str:
    """The line of a child's log that most likely says why it failed: a Python exception, else the last glog
    error (``E`` + date), else the last line."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    if not lines:
        return "(empty log)"
    if any(ln.startswith("Traceback") for ln in lines):
        return lines[-1]
    errors = [ln for ln in lines if len(ln) > 5 and ln[0] in "EF" and ln[1:5].isdigit()]
    return errors[-1] if errors else lines[-1]


def _stop_process(proc: subprocess.Popen[Any] | None, timeout_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_port(port: int, proc: subprocess.Popen[Any], what: str, log: Path) -> None:
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with code {proc.returncode}: {_last_line(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"{what} did not listen on port {port} within {SERVICE_START_TIMEOUT_S:.0f} s")


# --- Redis --------------------------------------------------------------------------------------------------------


def _check_redis() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise UsageError(
            "--vs-redis needs redis-server, which is not on PATH; install it: apt-get install -y redis-server"
        )
    if importlib.util.find_spec("redis") is None:
        raise UsageError("--vs-redis needs the redis Python package; install it: pip install redis")
    return exe


@contextlib.contextmanager
def _redis_server(exe: str, directory: Path) -> Iterator[int]:
    """redis-server on a free loopback port, no persistence; yields the port."""
    import redis

    log = directory / "redis.log"
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    cmd += ["--dir", str(directory), "--logfile", str(log), "--daemonize", "no"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    try:
        _wait_port(port, proc, "redis-server", log)
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=5)
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.BusyLoadingError:
                if time.monotonic() > deadline:
                    raise BenchError("redis-server did not finish loading") from None
                time.sleep(0.05)
        client.close()
        yield port
    finally:
        _stop_process(proc)


def run_redis(exe: str, spec: Spec, progress: ProgressView) -> dict[str, Any]:
    import redis

    with tempfile.TemporaryDirectory(prefix="kvbench-redis-") as tmp, _redis_server(exe, Path(tmp)) as port:
        sessions = [RedisSession(port) for _ in range(spec.concurrency)]
        try:
            result, _ = run_putget("redis", sessions, spec, progress)
            result["version"] = str(sessions[0].redis.info("server").get("redis_version", "?"))
        except redis.RedisError as exc:
            raise BenchError(f"redis: {exc}") from None
        finally:
            for s in sessions:
                s.close()
    return _with_raw(result, raw_stream_gbps(result["put"]["bytes"]))


# --- Mooncake Store -----------------------------------------------------------------------------------------------


def _mooncake_dir() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / "mooncake_master").exists():
            return Path(location)
    return None


def _check_mooncake() -> Path:
    """The folder of the installed ``mooncake`` package, once its store module is known to load."""
    folder = _mooncake_dir()
    if folder is None:
        raise UsageError(f"--vs-mooncake needs Mooncake Store; install it: pip install {MOONCAKE_DIST}")
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=120, check=False
    )
    if probe.returncode != 0:
        lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {probe.returncode}"
        hint = "; install it: apt-get install -y libibverbs1" if "libibverbs" in why else ""
        raise UsageError(f"--vs-mooncake: Mooncake Store does not load here: {why}{hint}")
    return folder


def _mooncake_version() -> str:
    try:
        return importlib.metadata.version(MOONCAKE_DIST)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _child(function: str, params: dict[str, Any], log: Path) -> subprocess.Popen[str]:
    code = f"import sys; from kvtier.tools.kvbench import {function} as f; sys.exit(f(sys.argv[1]))"
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(params)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            preexec_fn=_die_with_parent,
        )


def _read_messages(proc: subprocess.Popen[str], progress: ProgressView, what: str, log: Path) -> dict[str, Any]:
    """Follow a child's JSON lines (forwarding progress) until it reports a result, an error or exits."""
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "progress" in message:
            p = message["progress"]
            if p["event"] == "start":
                progress.start(p["label"], p["total"])
            elif p["event"] == "update":
                progress.update(p["label"], p["completed"])
            else:
                progress.finish(p["label"])
        elif "error" in message:
            proc.wait()
            if message.get("verify"):
                raise VerifyError(message["error"])
            raise BenchError(f"{message['error']} ({what}'s log: {_last_line(log)})")
        elif "result" in message or "ready" in message:
            return message
    code = proc.wait()
    raise BenchError(f"{what} exited with code {code} before reporting: {_last_line(log)}")


def run_mooncake(folder: Path, spec: Spec, progress: ProgressView) -> dict[str, Any]:
    """mooncake_master (HTTP metadata server built in), one store-server process, and a client process."""
    # the segment holds everything the run stores, far below the master's eviction watermark (0.9)
    segment = (spec.max_bytes * 13 // 10 + (256 << 20)) >> 20 << 20
    procs: list[subprocess.Popen[Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvbench-mooncake-") as tmp:
        try:
            for attempt in (1, 2):  # a second try, on fresh ports, when another process took one meanwhile
                logs = Path(tmp) / f"try-{attempt}"
                logs.mkdir()
                try:
                    params = _start_mooncake_services(folder, segment, spec, logs, procs, progress)
                    break
                except BenchError:
                    _stop_all(procs)
                    if attempt == 2:
                        raise
            client = _child("_mooncake_client_main", params, logs / "client.log")
            procs.append(client)
            result = _read_messages(client, progress, "the Mooncake client", logs / "client.log")["result"]
        finally:
            _stop_all(procs)
    result["version"] = _mooncake_version()
    return _with_raw(result, raw_stream_gbps(result["put"]["bytes"]))


def _start_mooncake_services(
    folder: Path, segment: int, spec: Spec, logs: Path, procs: list[subprocess.Popen[Any]], progress: ProgressView
) -> dict[str, Any]:
    """Start mooncake_master and the store server (appended to ``procs``); returns the client's parameters."""
    rpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    master_cmd = [
        str(folder / "mooncake_master"),
        f"--rpc_port={rpc_port}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http_port}",
        f"--metrics_port={metrics_port}",
    ]
    with open(logs / "master.log", "ab") as err:
        master = subprocess.Popen(
            master_cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, preexec_fn=_die_with_parent
        )
    procs.append(master)
    _wait_port(rpc_port, master, "mooncake_master", logs / "master.log")
    _wait_port(http_port, master, "mooncake_master's HTTP metadata server", logs / "master.log")
    params = {
        "metadata": f"http://127.0.0.1:{http_port}/metadata",
        "master": f"127.0.0.1:{rpc_port}",
        "segment": segment,
        "spec": spec.to_dict(),
    }
    server = _child("_mooncake_store_server_main", params, logs / "server.log")
    procs.append(server)
    _read_messages(server, progress, "the Mooncake store server", logs / "server.log")
    return params


def _stop_all(procs: list[subprocess.Popen[Any]]) -> None:
    while procs:
        proc = procs.pop()
        _stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def _mooncake_setup(params: dict[str, Any], segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", params["metadata"], segment, 16 << 20, "tcp", "", params["master"])
    if rc != 0:
        raise BenchError(f"mooncake setup returned {rc}")
    return store


def _mooncake_store_server_main(params_json: str) -> int:
    """Child process: hold the store's segment until SIGTERM."""
    params = json.loads(params_json)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        store = _mooncake_setup(params, params["segment"])
    except Exception as exc:
        print(json.dumps({"error": f"Mooncake store server: {exc}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    store.close()
    return 0


def _mooncake_client_main(params_json: str) -> int:
    """Child process: the Mooncake run (same phases as kvtier's), reported as JSON lines on stdout."""
    params = json.loads(params_json)
    spec = Spec.from_dict(params["spec"])
    try:
        store = _mooncake_setup(params, 0)
        lock = threading.Lock()
        sessions = [MooncakeSession(store, lock) for _ in range(spec.concurrency)]
        try:
            result, _ = run_putget("mooncake", sessions, spec, JsonLinesProgress())
        finally:
            for s in sessions:
                s.close()
        store.close()
    except BenchError as exc:
        print(json.dumps({"error": str(exc), "verify": isinstance(exc, VerifyError)}), flush=True)
        return 1
    print(json.dumps({"result": result}), flush=True)
    return 0


# --- command line -------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="kvtier benchmarks: put/get against a cluster, and trace replay.")
    parser.add_argument("--config", metavar="PATH", help="cluster file of a running cluster (default: a temporary one)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{putget,replay}")
    p = sub.add_parser(
        "putget",
        help="put/get throughput and latency, against a raw loopback stream",
        description="Put/get throughput and latency of kvtier (and optionally Redis and Mooncake Store), each "
        "as a ratio to one raw loopback TCP stream of the same bytes measured in the same run. Without --config, "
        "on a temporary local 12-node cluster.",
    )
    p.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--block-size", default="1MiB", metavar="SIZE", help="bytes per block (default 1MiB)")
    p.add_argument("--concurrency", default="1", metavar="N", help="worker threads, one client each (default 1)")
    p.add_argument("--duration", default="5", metavar="S", help="length of the put phase, e.g. 5 or 30s (default 5)")
    p.add_argument("--batch-bytes", default="16MiB", metavar="SIZE", help="bytes per put/get call (default 16MiB)")
    p.add_argument(
        "--max-bytes", default="4GiB", metavar="SIZE", help="stop the put phase once this much is stored (default 4GiB)"
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="skip the untimed fill pass: the timed puts land in space the store never used (first-touch costs)",
    )
    p.add_argument("--vs-redis", action="store_true", help="run the same phases against a local redis-server")
    p.add_argument("--vs-mooncake", action="store_true", help="run the same phases against a local Mooncake Store")
    p.add_argument(
        "--degraded", default="0", metavar="K", help="after the put phase, SIGKILL K nodes (1 or 2) and read again"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    r = sub.add_parser("replay", help="replay a request trace against a simulated store")
    add_replay_arguments(r)
    return parser


def _spec_from_args(args: argparse.Namespace) -> Spec:
    def size(option: str, text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise UsageError(f"{option}: {exc}") from None
        if value <= 0:
            raise UsageError(f"{option} {text!r}: must be positive")
        return value

    def integer(option: str, text: str, low: int, high: int) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{option} {text!r}: use a whole number") from None
        if not low <= value <= high:
            raise UsageError(f"{option} {text!r}: must be between {low} and {high}")
        return value

    block = size("--block-size", args.block_size)
    if block < KEY_BYTES:
        raise UsageError(f"--block-size {args.block_size!r}: must be at least {KEY_BYTES} B")
    if block > MAX_BLOCK_BYTES:
        raise UsageError(f"--block-size {args.block_size!r}: must be at most {format_size(MAX_BLOCK_BYTES)}")
    batch = size("--batch-bytes", args.batch_bytes)
    per_call = max(1, batch // block)
    if per_call > MAX_BLOCKS_PER_CALL:
        raise UsageError(
            f"--batch-bytes {args.batch_bytes} holds {per_call} blocks of {args.block_size}; at most "
            f"{MAX_BLOCKS_PER_CALL} per call: lower --batch-bytes"
        )
    concurrency = integer("--concurrency", args.concurrency, 1, MAX_CONCURRENCY)
    try:
        duration = parse_duration(args.duration)
    except ValueError as exc:
        raise UsageError(f"--duration: {exc}") from None
    max_bytes = size("--max-bytes", args.max_bytes)
    spec = Spec(block, per_call, concurrency, duration, max_bytes, fill=not args.fresh)
    if max_bytes < 2 * concurrency * spec.batch_bytes:
        raise UsageError(
            f"--max-bytes {args.max_bytes}: must hold at least two batches per worker "
            f"({format_size(2 * concurrency * spec.batch_bytes)})"
        )
    return spec


def putget(args: argparse.Namespace) -> int:
    spec = _spec_from_args(args)
    degraded = int(args.degraded) if args.degraded.strip().isdigit() else -1
    if not 0 <= degraded <= PARITY_SHARDS:
        raise UsageError(
            f"--degraded {args.degraded!r}: must be 1 or 2 (RS(10,2) reads survive at most {PARITY_SHARDS} lost nodes)"
        )
    args.degraded = degraded
    if degraded and args.config is not None:
        raise UsageError(
            "--degraded kills nodes, which kvbench only does to a cluster it started itself; leave out --config"
        )
    redis_exe = _check_redis() if args.vs_redis else None
    mooncake_folder = _check_mooncake() if args.vs_mooncake else None

    progress: ProgressView = ProgressView()
    if not args.json and sys.stderr.isatty():
        progress = RichProgress()
    try:
        kvtier, cluster = run_kvtier(args, spec, progress)
        report: dict[str, Any] = {
            "command": "putget",
            "settings": {**spec.to_dict(), "degraded": degraded},
            "cluster": cluster,
            "kvtier": kvtier,
        }
        if redis_exe is not None:
            report["redis"] = run_redis(redis_exe, spec, progress)
        if mooncake_folder is not None:
            report["mooncake"] = run_mooncake(mooncake_folder, spec, progress)
    finally:
        progress.close()
    report["verified_blocks"] = sum(_verified(report[s]) for s in ("kvtier", "redis", "mooncake") if s in report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


def _print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    settings, cluster = report["settings"], report["cluster"]
    where = (
        f"temporary {cluster['nodes']}-node local cluster"
        if cluster["kind"] == "temporary"
        else f"cluster {cluster['path']} ({cluster['nodes']} nodes)"
    )
    title = (
        f"kvbench putget: {format_size(settings['block_size'])} blocks, {settings['blocks_per_call']} per call "
        f"({format_size(settings['batch_bytes'])}), concurrency {settings['concurrency']}, "
        f"{settings['duration_s']:g} s put phase\n{where}, codec {cluster['codec_backend']}"
    )
    table = Table(title=title)
    for name, justify in (
        ("system / phase", "left"),
        ("GB/s", "right"),
        ("x raw", "right"),
        ("blocks/s", "right"),
        ("p50 ms", "right"),
        ("p99 ms", "right"),
        ("p999 ms", "right"),
        ("calls", "right"),
        ("data", "right"),
        ("raw GB/s", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    killed = cluster["killed_nodes"]
    names = {
        "put": "put",
        "get": "get",
        "get_degraded": f"get, node{'s' if len(killed) > 1 else ''} {', '.join(map(str, killed))} killed",
    }
    labels = {"kvtier": "kvtier", "redis": "redis (SET/MGET)", "mooncake": "mooncake (zero-copy)"}
    for system in ("kvtier", "redis", "mooncake"):
        if system not in report:
            continue
        result = report[system]
        for phase in ("put", "get", "get_degraded"):
            if phase not in result:
                continue
            r = result[phase]
            lat = r["latency_ms"]
            table.add_row(
                f"{labels[system]} {names[phase]}",
                f"{r['gbps']:.2f}",
                f"{r['ratio_to_raw']:.2f}x" if r["ratio_to_raw"] is not None else "-",
                f"{r['blocks_per_s']:,.0f}",
                f"{lat['p50']:.2f}",
                f"{lat['p99']:.2f}",
                f"{lat['p999']:.2f}",
                f"{r['calls']:,}",
                format_size(r["bytes"]),
                f"{result['raw_stream_gbps']:.2f}",
            )
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table)
    notes = []
    capped = [
        s for s in ("kvtier", "redis", "mooncake") if s in report and report[s]["put"]["stopped_by"] == "max_bytes"
    ]
    if capped:
        cap = format_size(settings["max_bytes"])
        notes.append(
            f"put phase stopped before {settings['duration_s']:g} s at --max-bytes ({cap}): {', '.join(capped)}"
        )
    if not settings["fill"]:
        notes.append("--fresh: the timed puts went into space the stores had never used")
    notes.append(f"{report['verified_blocks']:,} blocks read back and verified byte for byte")
    notes.append("x raw: GB/s over that of one raw loopback TCP stream of the same bytes, measured in the same run")
    for note in notes:
        console.print(note, highlight=False)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "replay":
        return run_replay(args)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # stop nodes and servers on the way out, as Ctrl-C does
    try:
        return putget(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except VerifyError as exc:
        print(f"{PROG}: DATA MISMATCH: {exc}", file=sys.stderr)
        return 1
    except BenchError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
