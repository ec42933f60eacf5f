"""The floor of the store's data path on this machine: the bytes a put and a read move, with none of the store.

    python benchmarks/floor_bench.py [--sizes 64KiB,1MiB,4MiB] [--batch 64MiB] [--rounds 5]
                                     [--modes fresh,capacity] [--fill-page-cache] [--against-store]

``store_bench`` compares kvtier with one raw stream over a Unix socket (how a client reaches the nodes of its own
machine). A put cannot move bytes as cheaply as that stream:
it encodes parity, sends 1.2 times the bytes to 12 processes, and each of them receives, checksums and writes
its shards into slab files (a second copy, into the page cache) that the kernel then writes back to disk. A read
sends from the page cache and checksums what lands. This benchmark does exactly that work and nothing else, so
that the gap between kvtier and the raw stream splits into what the design costs on this machine (this floor)
and what the implementation adds on top (kvtier against the floor):

- 12 server processes, each with real slab files (``kvstore.node.slabs.SlabFiles``: the node's files, extents and
  ``posix_fallocate``d slots). ``fresh``: new slots every round, as an empty cluster's puts land in file space
  never written. ``capacity``: every put overwrites the slots of the one before, whose pages are in the page
  cache, as a full cluster reuses the slots its evictions free. Per put: one small header,
  then the shards received by ``_native.recv_to_files`` (the node's receive loop: cache-sized pieces, crc32c,
  ``pwritev`` of runs of adjacent slots), and the crcs sent back. Per read: the last put's shards sent from the
  slab mappings by ``_native.send_all``.
- One client: parity of every block by ISA-L (``Codec.encode_parity_at``, in windows as the client encodes,
  sending each window while the next is encoded), shard ``j`` of every block to server ``j``, gathered by
  ``_native.send_some`` on non-blocking sockets; a read asks the 10 data-shard servers and receives straight into
  caller-owned blocks with ``_native.recv_scatter``, checking every shard's crc32c.

No metadata, no placement, no framing beyond a 16-byte header, no Python per shard. What kvtier spends above
these figures is its own overhead; what these figures lack of the issue's targets no implementation of this
design gets on this machine. Ratios are to one raw Unix stream of the same bytes in the same round (the servers are
reached by Unix sockets, as kvtier's are); a raw loopback TCP stream is reported beside it.

``--against-store`` (fresh mode): a 12-node kvtier cluster runs beside the floor's servers, and every round puts
and reads the same blocks through both (new keys each round), alternating which goes first, so that kvtier's rate
is given as a fraction of the floor's in the same round. The raw stream moves between 2 and 5 GB/s from run to run
on a shared machine, and a ratio of two runs' ratios to it is mostly that noise.

This is a benchmark, never a test: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvtier.kvstore import _native
from kvtier.kvstore.client import Client
from kvtier.kvstore.codec import DATA_SHARDS, TOTAL_SHARDS, Codec
from kvtier.kvstore.node.slabs import SIZE_CLASSES, SlabFiles, size_class_for
from kvtier.kvstore.units import format_size, parse_size
from kvtier.tools.benchutil import CpuMeter, page_cache_filled, raw_stream_gbps, temp_cluster

HEAD = struct.Struct("<4sQI")  # op, shards, shard bytes
PUT, GET = b"PUT ", b"GET "
RECV_PIECE_BYTES = 256 << 10  # as the node receives
ENCODE_WINDOW = 4 << 20  # as the client encodes: this many block bytes first, then windows as big as all before


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return b""
        got += k
    return bytes(buf)


def serve(directory: str, overwrite: bool) -> None:
    """One floor server: accept one client, then answer its puts and reads until it hangs up; ``overwrite``: a
    put of as many shards of the same size as the last one writes into the same slots."""
    slabs = SlabFiles(Path(directory))
    scratch = bytearray(RECV_PIECE_BYTES)
    last: tuple[int, np.ndarray, int] | None = None
    path = str(Path(directory) / "floor.sock")  # as a node on the client's machine is reached: a Unix socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        print(path, flush=True)
        conn, _ = listener.accept()
    with conn:
        while head := _recv_exact(conn, HEAD.size):
            op, count, length = HEAD.unpack(head)
            size_class = size_class_for(length)
            if op == PUT:
                if overwrite and last is not None and last[0] == size_class and len(last[1]) == count:
                    slots = last[1]
                else:
                    slots = slabs.allocate(size_class, count)
                plan = np.empty((count, 4), dtype=np.int64)
                plan[:, 0] = slabs.fd(size_class)
                plan[:, 1] = slots * SIZE_CLASSES[size_class]
                plan[:, 2] = length
                plan[:, 3] = SIZE_CLASSES[size_class]
                conn.sendall(_native.recv_to_files(conn.fileno(), -1, plan, scratch))
                last = (size_class, slots, length)
            elif op == GET and last is not None:
                _native.send_all(conn.fileno(), -1, [_slab_pieces(slabs, *last)])


def _slab_pieces(slabs: SlabFiles, size_class: int, slots: np.ndarray, length: int) -> _native.Scatter:
    """The shards in ``slots`` as one Scatter over the slab mappings (a view per extent, as a node's read pins)."""
    per_extent = slabs.extent_slots(size_class)
    extents = slots // per_extent
    firsts = np.unique(extents)
    keep = [slabs.view(size_class, int(e) * per_extent, 0) for e in firsts.tolist()]
    bases = np.frombuffer(_native.addresses(keep), dtype=np.int64)
    plan = np.empty((len(slots), 2), dtype=np.int64)
    plan[:, 0] = bases[np.searchsorted(firsts, extents)] + (slots - extents * per_extent) * SIZE_CLASSES[size_class]
    plan[:, 1] = length
    return _native.Scatter(plan, keep)


class Floor:
    """12 floor servers and the client's side of them."""

    def __init__(self, stack: contextlib.ExitStack, overwrite: bool) -> None:
        self.procs, self.socks = [], []
        for j in range(TOTAL_SHARDS):
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvtier-floor-{j}-"))
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", directory, *(["--overwrite"] if overwrite else [])],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
            )
            stack.callback(proc.wait)
            stack.callback(proc.kill)
            assert proc.stdout is not None
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stack.callback(sock.close)
            sock.connect(proc.stdout.readline().decode().strip())
            self.procs.append(proc)
            self.socks.append(sock)
        self.meter = CpuMeter([proc.pid for proc in self.procs])
        self.codec = Codec()
        self.selector = selectors.DefaultSelector()
        stack.callback(self.selector.close)

    def put(self, blocks: np.ndarray, parity: np.ndarray) -> np.ndarray:
        """Encode and send every block's 12 shards (shard ``j`` to server ``j``); the servers' crcs, n × 12."""
        n, shard = blocks.shape[0], blocks.shape[1] // DATA_SHARDS
        table = np.empty((n, TOTAL_SHARDS), dtype=np.int64)
        table[:, :DATA_SHARDS] = blocks.ctypes.data + np.arange(n)[:, None] * blocks.strides[0]
        table[:, :DATA_SHARDS] += np.arange(DATA_SHARDS) * shard
        table[:, DATA_SHARDS:] = parity.ctypes.data + np.arange(n)[:, None] * parity.strides[0]
        table[:, DATA_SHARDS:] += np.arange(TOTAL_SHARDS - DATA_SHARDS) * shard
        for sock in self.socks:
            sock.sendall(HEAD.pack(PUT, n, shard))
        lo, hi = 0, max(1, ENCODE_WINDOW // blocks.shape[1])
        while lo < n:
            hi = min(hi, n)
            self.codec.encode_parity_at(table[lo:hi], np.full(hi - lo, shard, dtype=np.int64))
            plans = [np.stack([table[lo:hi, j], np.full(hi - lo, shard)], axis=1) for j in range(TOTAL_SHARDS)]
            self._send_all([_native.Scatter(np.ascontiguousarray(p), blocks) for p in plans])
            lo, hi = hi, 2 * hi
        crcs = [np.frombuffer(_recv_exact(sock, 4 * n), dtype="<u4") for sock in self.socks]
        return np.stack(crcs, axis=1)

    def _send_all(self, scatters: list[_native.Scatter]) -> None:
        sent = [0] * len(scatters)
        for sock in self.socks:
            sock.setblocking(False)
        try:
            waiting = set(range(len(scatters)))
            while waiting:
                for j in list(waiting):
                    with contextlib.suppress(BlockingIOError):
                        sent[j] += _native.send_some(self.socks[j].fileno(), [scatters[j]], sent[j])
                    if sent[j] == len(scatters[j]):
                        waiting.discard(j)
                if waiting:
                    _wait(self.selector, [self.socks[j] for j in waiting], selectors.EVENT_WRITE)
        finally:
            for sock in self.socks:
                sock.setblocking(True)

    def round(self, blocks: np.ndarray, parity: np.ndarray, into: np.ndarray) -> dict[str, float]:
        """A put of ``blocks`` and a read of them into ``into``: seconds and CPU seconds of each."""
        crcs, put_s, put_cpu = self.meter.timed(lambda: self.put(blocks, parity))
        _, get_s, get_cpu = self.meter.timed(lambda: self.get_into(into, crcs))
        return {"put": put_s, "get_into": get_s, "put_cpu": put_cpu, "get_into_cpu": get_cpu}

    def get_into(self, blocks: np.ndarray, expected: np.ndarray) -> None:
        """Read the last put's data shards into ``blocks``, checking every shard's crc32c against ``expected``."""
        n, shard = blocks.shape[0], blocks.shape[1] // DATA_SHARDS
        socks = self.socks[:DATA_SHARDS]
        crcs = np.zeros((DATA_SHARDS, n), dtype="<u4")
        plans, done = [], [0] * DATA_SHARDS
        for j, sock in enumerate(socks):
            sock.sendall(HEAD.pack(GET, n, shard))
            plan = np.empty((n, 3), dtype=np.int64)
            plan[:, 0] = blocks.ctypes.data + np.arange(n) * blocks.strides[0] + j * shard
            plan[:, 1] = shard
            plan[:, 2] = np.arange(n)
            plans.append(plan)
            sock.setblocking(False)
        try:
            waiting = set(range(DATA_SHARDS))
            while waiting:
                for j in list(waiting):
                    with contextlib.suppress(BlockingIOError):
                        done[j] += _native.recv_scatter(socks[j].fileno(), plans[j], done[j], crcs[j])
                    if done[j] == n * shard:
                        waiting.discard(j)
                if waiting:
                    _wait(self.selector, [socks[j] for j in waiting], selectors.EVENT_READ)
        finally:
            for sock in socks:
                sock.setblocking(True)
        if not np.array_equal(crcs.T, expected[:, :DATA_SHARDS]):
            raise RuntimeError("a shard came back with another crc32c than it was stored with")


def against_store(floor: Floor, block_size: int, batch_bytes: int, rounds: int) -> dict[str, float]:
    """Medians over rounds of kvtier's put and ``get_into`` rates as fractions of the floor's in the same round, and
    each side's GB/s and CPU s/GB (the floor's servers or kvtier's nodes, with this process)."""
    shard = -(-block_size // DATA_SHARDS)
    n = max(1, batch_bytes // block_size)
    blocks = np.random.default_rng(block_size).integers(0, 256, (n, shard * DATA_SHARDS), dtype=np.uint8)
    parity = np.empty((n, shard * (TOTAL_SHARDS - DATA_SHARDS)), dtype=np.uint8)
    into = np.ones_like(blocks)
    sources = [memoryview(row[:block_size]) for row in blocks]
    targets = [memoryview(row[:block_size]) for row in into]
    gb = n * block_size / 1e9
    samples: list[dict[str, float]] = []
    with temp_cluster(nodes=TOTAL_SHARDS) as local, Client(local.config) as writer, Client(local.config) as reader:
        nodes = CpuMeter([proc.pid for proc in local.procs.values()])

        def through_store() -> dict[str, float]:
            keys = [os.urandom(16) for _ in range(n)]
            stored, put_s, put_cpu = nodes.timed(lambda: writer.put(keys, sources))
            found, get_s, get_cpu = nodes.timed(lambda: reader.get_into(keys, targets))
            if not (all(stored) and all(found)):
                raise RuntimeError("kvtier did not store or read back every block")
            return {"put": put_s, "get_into": get_s, "put_cpu": put_cpu, "get_into_cpu": get_cpu}

        for r in range(rounds + 1):
            if r % 2:
                theirs, ours = floor.round(blocks, parity, into), through_store()
            else:
                ours, theirs = through_store(), floor.round(blocks, parity, into)
            if not np.array_equal(into[:, :block_size], blocks[:, :block_size]):
                raise RuntimeError("a read returned wrong bytes")
            if r:  # round 0 warms up
                sample = {f"{op}_of_floor": theirs[op] / ours[op] for op in ("put", "get_into")}
                for side, t in (("floor", theirs), ("kvtier", ours)):
                    sample |= {f"{side}_{op}_gbps": gb / t[op] for op in ("put", "get_into")}
                    sample |= {f"{side}_{op}_cpu": t[f"{op}_cpu"] / gb for op in ("put", "get_into")}
                samples.append(sample)
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def _wait(selector: selectors.BaseSelector, socks: list[socket.socket], event: int) -> None:
    for sock in socks:
        selector.register(sock, event)
    try:
        selector.select(timeout=10)
    finally:
        for sock in socks:
            selector.unregister(sock)


def bench_size(floor: Floor, block_size: int, batch_bytes: int, rounds: int) -> dict[str, float]:
    """Median ratios to the raw stream, and CPU s/GB, of put and get_into of ``block_size`` blocks."""
    shard = -(-block_size // DATA_SHARDS)
    n = max(1, batch_bytes // block_size)
    rng = np.random.default_rng(block_size)
    blocks = rng.integers(0, 256, (n, shard * DATA_SHARDS), dtype=np.uint8)
    parity = np.empty((n, shard * (TOTAL_SHARDS - DATA_SHARDS)), dtype=np.uint8)
    into = np.ones_like(blocks)
    samples: list[dict[str, float]] = []
    for r in range(rounds + 1):
        raw, raw_tcp = raw_stream_gbps(n * block_size, unix=True), raw_stream_gbps(n * block_size)
        t = floor.round(blocks, parity, into)
        put_s, put_cpu, get_s, get_cpu = t["put"], t["put_cpu"], t["get_into"], t["get_into_cpu"]
        if not np.array_equal(into, blocks):
            raise RuntimeError("get_into returned wrong bytes")
        gb = n * block_size / 1e9
        if r:  # round 0 warms up
            samples.append(
                {
                    "raw": raw,
                    "raw_tcp": raw_tcp,
                    "put_ratio": gb / put_s / raw,
                    "get_into_ratio": gb / get_s / raw,
                    "put_cpu": put_cpu / gb,
                    "get_into_cpu": get_cpu / gb,
                }
            )
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


@contextlib.contextmanager
def _maybe_filled(fill: bool) -> Iterator[None]:
    if not fill:
        yield
        return
    with page_cache_filled(tempfile.gettempdir()):
        yield


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64KiB,1MiB,4MiB")
    parser.add_argument("--batch", default="64MiB", help="block bytes moved per put and per read")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per size (medians)")
    parser.add_argument("--modes", default="fresh,capacity", help="fresh, capacity or both")
    parser.add_argument("--fill-page-cache", action="store_true", help="as store_bench: memory full of page cache")
    parser.add_argument("--against-store", action="store_true", help="kvtier beside the floor, round by round")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--overwrite", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.overwrite)
        return 0
    modes = [m.strip() for m in args.modes.split(",")]
    if not modes or any(m not in ("fresh", "capacity") for m in modes):
        parser.error("--modes takes a comma-separated list of fresh, capacity")
    if args.against_store:
        return _against_store(args)
    print("floor of the data path: 12 server processes with slab files, one client; no metadata, no Python per shard")
    print("ratios to the raw Unix stream (median of rounds); CPU s/GB: client + servers")
    heading = f"{'mode':>8} {'block':>7} {'raw GB/s':>8} {'(TCP)':>6} {'put':>6} {'get_into':>8}"
    print(f"{heading}   {'CPU s/GB: put':>13} {'get_into':>8}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_maybe_filled(args.fill_page_cache))
        for mode in modes:
            with contextlib.ExitStack() as servers:
                floor = Floor(servers, overwrite=mode == "capacity")
                for size in (parse_size(s) for s in args.sizes.split(",")):
                    r = bench_size(floor, size, parse_size(args.batch), args.rounds)
                    print(
                        f"{mode:>8} {format_size(size):>7} {r['raw']:>8.2f} {r['raw_tcp']:>6.2f} "
                        f"{r['put_ratio']:>5.2f}x {r['get_into_ratio']:>7.2f}x   "
                        f"{r['put_cpu']:>13.2f} {r['get_into_cpu']:>8.2f}",
                        flush=True,
                    )
    return 0


def _against_store(args: argparse.Namespace) -> int:
    print("kvtier against the floor in the same rounds (fresh: new keys, new slots every round); medians of rounds")
    heading = f"{'block':>7} {'put':>6} {'get_into':>8}   {'GB/s put floor/kvtier':>21} {'get_into floor/kvtier':>21}"
    print(f"{heading}   {'CPU s/GB put floor/kvtier':>25} {'get_into floor/kvtier':>21}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_maybe_filled(args.fill_page_cache))
        floor = Floor(stack, overwrite=False)
        for size in (parse_size(s) for s in args.sizes.split(",")):
            r = against_store(floor, size, parse_size(args.batch), args.rounds)
            print(
                f"{format_size(size):>7} {r['put_of_floor']:>5.2f}x {r['get_into_of_floor']:>7.2f}x   "
                f"{r['floor_put_gbps']:>10.2f} / {r['kvtier_put_gbps']:<8.2f} "
                f"{r['floor_get_into_gbps']:>10.2f} / {r['kvtier_get_into_gbps']:<8.2f}   "
                f"{r['floor_put_cpu']:>14.2f} / {r['kvtier_put_cpu']:<8.2f} "
                f"{r['floor_get_into_cpu']:>10.2f} / {r['kvtier_get_into_cpu']:<8.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
