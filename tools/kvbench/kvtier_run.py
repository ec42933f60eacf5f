"""kvbench putget on kvtier: a temporary local cluster, or the running one of ``--config``."""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.kvstore.client import CapacityError, Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.codec import DATA_SHARDS, PARITY_SHARDS
from kvtier.kvstore.wire.transport import AuthError
from kvtier.tools.benchutil import raw_stream_gbps, temp_cluster
from kvtier.tools.kvbench.common import (
    PROG,
    BenchError,
    ProgressView,
    UsageError,
    VerifyError,
    cluster_config,
    last_line,
)
from kvtier.tools.kvbench.phases import (
    KEY_BYTES,
    Calls,
    Session,
    Spec,
    Worker,
    block_views,
    phase_summary,
    run_putget,
    with_raw,
)

GRACE_S = 0.5  # [gc] grace_s of the temporary cluster: deleted blocks' slots are reused soon (steady state)
FILL_FACTOR = 1.5  # --at-capacity: the untimed fill offers this many times what the cluster holds


class KvtierSession(Session):
    """Puts through one client, reads through a second that never wrote the blocks (as another process would)."""

    def __init__(self, config: cluster_mod.ClusterConfig) -> None:
        self.client = Client(config)
        self.reader = Client(config)
        self.settle_s = config.gc.grace_s + 0.5  # a deleted block's slots are reused after the grace time

    def attach(self, src: bytearray, dst: bytearray, spec: Spec) -> None:
        super().attach(src, dst, spec)
        self.src_views = block_views(src, spec.block_size)
        self.dst_views = block_views(dst, spec.block_size)

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
        return self.reader.get_into(keys, self.dst_views)

    def delete(self, keys: list[bytes]) -> None:
        self.client.delete(keys)

    def close(self) -> None:
        self.client.close()
        self.reader.close()


def get_alloc_phase(system: str, workers: Sequence[Worker]) -> dict[str, Any]:
    """The get phase again, with ``get`` (kvtier allocates the blocks it returns) instead of ``get_into``: every
    batch each worker stored, read once through its reader client, one worker after another, checked byte for
    byte."""
    calls = []
    started = time.perf_counter()
    for w in workers:
        assert isinstance(w.session, KvtierSession)
        done = Calls()
        for keys in w.batches:
            w.stamp(keys)
            start = time.perf_counter()
            blocks = w.session.reader.get(keys)
            done.intervals.append((start, time.perf_counter()))
            done.bytes += w.spec.batch_bytes
            done.blocks += len(keys)
            for key, block, want in zip(keys, blocks, block_views(w.src, w.spec.block_size), strict=True):
                if block != want:
                    raise VerifyError(f"{system} get (allocating): block {key.hex()} missing or wrong")
        calls.append(done)
    return phase_summary(calls, time.perf_counter() - started)


def prefill_past_capacity(config: cluster_mod.ClusterConfig, spec: Spec, progress: ProgressView) -> None:
    """Untimed: put fresh blocks until the cluster has taken FILL_FACTOR times what it holds, so that every
    timed put afterwards finds it full and the store evicts to take it."""
    holds = sum(n.capacity_bytes for n in config.nodes.values()) * DATA_SHARDS // (DATA_SHARDS + PARITY_SHARDS)
    block = bytes(spec.block_size)
    label = "kvtier fill past capacity (untimed)"
    progress.start(label, FILL_FACTOR * holds)
    offered = 0
    with Client(config) as client:
        while offered < FILL_FACTOR * holds:
            keys = [os.urandom(KEY_BYTES) for _ in range(spec.blocks_per_call)]
            try:
                client.put(keys, [block] * len(keys))
            except CapacityError as exc:
                raise BenchError(f"kvtier: a full cluster refused writes: {exc}") from None
            offered += spec.batch_bytes
            progress.update(label, offered)
    progress.finish(label)


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
        config = cluster_config(args)
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
            result["get_alloc"] = get_alloc_phase("kvtier", workers)
        finally:
            _cleanup(sessions, workers)
        cluster = {
            "kind": "config",
            "path": str(Path(args.config).resolve()),
            "nodes": len(config.nodes),
            "codec_backend": sessions[0].client.codec.backend,
            "killed_nodes": [],
            "at_capacity": False,
        }
    else:
        # each node holds about a tenth of the data plus parity and slot slack; stay far below the watermarks
        capacity = max(1 << 30, -(-spec.max_bytes * 2 // 10 // (1 << 20)) << 20)
        if args.at_capacity:
            # the timed blocks (at most --max-bytes) take under half of what the cluster holds, so none of them is
            # evicted before the get phase reads it back: the evictions fall on the untimed fill's blocks
            capacity = -(-spec.max_bytes * 2 * (DATA_SHARDS + PARITY_SHARDS) // DATA_SHARDS // 12 // (1 << 20)) << 20
        killed: list[int] = []
        with temp_cluster(12, capacity, grace_s=GRACE_S, prefix="kvbench-") as local:
            if args.at_capacity:
                prefill_past_capacity(local.config, spec, progress)
            sessions = [KvtierSession(local.config) for _ in range(spec.concurrency)]

            def degrade() -> None:
                victims = sorted(random.sample(local.local_ids, args.degraded))
                for nid in victims:
                    local.kill(nid, signal.SIGKILL)
                killed.extend(victims)

            try:
                result, workers = run_putget("kvtier", sessions, spec, progress, degrade if args.degraded else None)
                if not args.degraded:  # with nodes killed the degraded phase already re-read everything
                    result["get_alloc"] = get_alloc_phase("kvtier", workers)
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
                "at_capacity": bool(args.at_capacity),
                "node_capacity": capacity,
            }
    return with_raw(result, raw_stream_gbps(result["put"]["bytes"])), cluster


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
            notes.append(f"node {nid} {state}: {last_line(log) if said else 'no log'}")
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
