"""Throughput of the RS(10, 2) codec on one core, against the raw ISA-L call and zfec.

Usage: python benchmarks/codec_bench.py [--sizes 64KiB,1MiB,4MiB] [--json] [--cpu N] [--repeat 7] [--min-time 0.05]

For every block size and every backend that loads, this times ``Codec.encode_parity`` (10 read-only
memoryview slices of the block in, 2 slices of one bytearray out) and ``Codec.reconstruct`` with data
shards 0 and 1 lost, and next to them the bare ``ec_encode_data`` call of the same library on preallocated
pointer arrays, plus zfec as an outside reference. GB/s counts block bytes (1 GB = 1e9 bytes); every figure
is the median of several repetitions.
"""

import argparse
import ctypes
import functools
import json
import os
import platform
import re
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np
import zfec

from kvtier.kvstore.codec import DATA_SHARDS, PARITY_SHARDS, TOTAL_SHARDS, Codec, available_backends, shard_size

LOST = (0, 1)
UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_sizes(text: str) -> list[int]:
    """Comma-separated sizes in bytes, each with an optional unit: ``65536,64KiB,1MiB``."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B|B)?\s*", item)
        if not match or int(match[1]) == 0:
            raise argparse.ArgumentTypeError(f"not a size: {item!r} (e.g. 65536, 64KiB, 1MiB)")
        sizes.append(int(match[1]) * UNITS[match[2] or ""])
    return sizes


def seconds_per_call(fns: dict[str, Callable[[], object]], repeat: int, min_time: float) -> dict[str, float]:
    """Median seconds per call of each function, over ``repeat`` timed runs of at least ``min_time`` seconds.

    The runs of different functions are interleaved, so that a busy neighbour slows all of them alike.
    """
    timers = {name: timeit.Timer(fn) for name, fn in fns.items()}
    numbers = {}
    for name, timer in timers.items():
        number = 1
        while (elapsed := timer.timeit(number)) < min_time:
            number = max(number + 1, int(number * min_time / max(elapsed, 1e-9) * 1.2))
        numbers[name] = number
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, timer in timers.items():
            samples[name].append(timer.timeit(numbers[name]) / numbers[name])
    return {name: statistics.median(times) for name, times in samples.items()}


class RawIsal:
    """The bare library calls for this benchmark's encode and decode, on preallocated pointer arrays."""

    def __init__(self, path: str, data: list[memoryview], parity: list[memoryview], want: list[memoryview]) -> None:
        lib = ctypes.CDLL(path)
        self.encode_data = lib.ec_encode_data
        self.encode_data.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3
        self.encode_data.restype = None
        k, rows = DATA_SHARDS, PARITY_SHARDS
        matrix = (ctypes.c_ubyte * (TOTAL_SHARDS * k))()
        lib.gf_gen_cauchy1_matrix(matrix, TOTAL_SHARDS, k)
        survivors = [i for i in range(TOTAL_SHARDS) if i not in LOST][:k]
        square = (ctypes.c_ubyte * (k * k))(*(matrix[i * k + j] for i in survivors for j in range(k)))
        inverse = (ctypes.c_ubyte * (k * k))()
        if lib.gf_invert_matrix(square, inverse, k) != 0:
            raise RuntimeError("decode matrix is singular")
        decode_rows = (ctypes.c_ubyte * (rows * k))(*(inverse[i * k + j] for i in LOST for j in range(k)))
        self.encode_tables = (ctypes.c_ubyte * (32 * k * rows))()
        self.decode_tables = (ctypes.c_ubyte * (32 * k * rows))()
        lib.ec_init_tables(k, rows, ctypes.byref(matrix, k * k), self.encode_tables)
        lib.ec_init_tables(k, rows, decode_rows, self.decode_tables)
        shards = data + parity
        self.size = data[0].nbytes
        self.data = pointer_array(data)
        self.parity = pointer_array(parity)
        self.survivors = pointer_array([shards[i] for i in survivors])
        self.want = pointer_array(want)

    def encode(self) -> None:
        self.encode_data(self.size, DATA_SHARDS, PARITY_SHARDS, self.encode_tables, self.data, self.parity)

    def decode(self) -> None:
        self.encode_data(self.size, DATA_SHARDS, len(LOST), self.decode_tables, self.survivors, self.want)


def pointer_array(views: list[memoryview]) -> ctypes.Array[ctypes.c_void_p]:
    return (ctypes.c_void_p * len(views))(*(np.frombuffer(v, np.uint8).ctypes.data for v in views))


def bench_size(block_len: int, repeat: int, min_time: float) -> list[dict[str, Any]]:
    size = shard_size(block_len)
    block = np.random.default_rng(block_len).bytes(DATA_SHARDS * size)  # whole shards, so data are slices
    view = memoryview(block)
    data = [view[i * size : (i + 1) * size] for i in range(DATA_SHARDS)]
    parity_buf = memoryview(bytearray(PARITY_SHARDS * size))
    parity = [parity_buf[i * size : (i + 1) * size] for i in range(PARITY_SHARDS)]
    want_buf = memoryview(bytearray(len(LOST) * size))
    want = [want_buf[i * size : (i + 1) * size] for i in range(len(LOST))]
    expected_parity = Codec("numpy").encode(block)[DATA_SHARDS:]
    present = {i: s for i, s in enumerate(data + parity) if i not in LOST}
    wanted = dict(zip(LOST, want, strict=True))

    codecs = {backend: Codec(backend) for backend in available_backends()}
    raws = {b: RawIsal(c.library, data, parity, want) for b, c in codecs.items() if c.library is not None}
    encoder, decoder = zfec.Encoder(DATA_SHARDS, TOTAL_SHARDS), zfec.Decoder(DATA_SHARDS, TOTAL_SHARDS)
    data_bytes = [bytes(d) for d in data]
    zfec_parity = encoder.encode(data_bytes, list(range(DATA_SHARDS, TOTAL_SHARDS)))
    survivors = sorted(present)
    zfec_shares = [data_bytes[i] if i < DATA_SHARDS else zfec_parity[i - DATA_SHARDS] for i in survivors]

    impls: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    for backend, codec in codecs.items():
        impls[f"Codec[{backend}]"] = (
            functools.partial(codec.encode_parity, data, parity),
            functools.partial(codec.reconstruct, present, wanted),
        )
        if backend in raws:
            impls[f"raw ec_encode_data[{backend}]"] = (raws[backend].encode, raws[backend].decode)
    for impl, (encode, decode) in impls.items():
        encode()
        decode()
        check(parity, want, data, expected_parity, impl)
    impls["zfec"] = (
        functools.partial(encoder.encode, data_bytes, list(range(DATA_SHARDS, TOTAL_SHARDS))),
        functools.partial(decoder.decode, zfec_shares, survivors),
    )

    timed = seconds_per_call(
        {(impl, op): fn for impl, fns in impls.items() for op, fn in zip(("encode", "decode"), fns, strict=True)},
        repeat,
        min_time,
    )
    rows = []
    for impl in impls:
        backend = next((b for b in codecs if impl.endswith(f"[{b}]")), None)
        r: dict[str, Any] = {"block_bytes": block_len, "impl": impl, "backend": backend}
        r["library"] = codecs[backend].library if backend else None
        for op in ("encode", "decode"):
            r[f"{op}_us"] = timed[impl, op] * 1e6
            r[f"{op}_gbps"] = block_len / timed[impl, op] / 1e9
            if impl.startswith("Codec") and backend in raws:
                r[f"{op}_vs_raw"] = timed[f"raw ec_encode_data[{backend}]", op] / timed[impl, op]
        rows.append(r)
    return rows


def check(parity: list[memoryview], want: list[memoryview], data: list[memoryview], expected: list[bytes], impl: str):
    """The calls just made must have produced the right parity and lost shards; clears them for the next."""
    if [bytes(p) for p in parity] != expected or [bytes(w) for w in want] != [bytes(data[i]) for i in LOST]:
        raise AssertionError(f"{impl} produced wrong shards")
    for buf in (*parity, *want):
        buf[:] = bytes(len(buf))


def human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def print_table(rows: list[dict[str, Any]], cpu: int) -> None:
    print(f"RS(10, 2) on one core (cpu {cpu}: {cpu_model()}), Python {platform.python_version()}")
    for backend in available_backends():
        lib = next((r["library"] for r in rows if r.get("backend") == backend), None)
        print(f"  {backend}: {lib or 'numpy'}")
    print(f"decode: data shards {LOST} lost; GB/s = block bytes / s; x raw = raw call time / Codec call time\n")
    header = f"{'block':>9}  {'implementation':<33} {'enc GB/s':>9} {'enc us':>9} {'x raw':>6}"
    header += f" {'dec GB/s':>9} {'dec us':>9} {'x raw':>6}"
    print(header)
    print("-" * len(header))
    last = None
    for r in rows:
        size = human(r["block_bytes"]) if r["block_bytes"] != last else ""
        last = r["block_bytes"]
        enc_ratio = f"{r['encode_vs_raw']:.2f}" if "encode_vs_raw" in r else ""
        dec_ratio = f"{r['decode_vs_raw']:.2f}" if "decode_vs_raw" in r else ""
        print(
            f"{size:>9}  {r['impl']:<33} {r['encode_gbps']:>9.2f} {r['encode_us']:>9.1f} {enc_ratio:>6}"
            f" {r['decode_gbps']:>9.2f} {r['decode_us']:>9.1f} {dec_ratio:>6}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=parse_sizes, default="64KiB,1MiB,4MiB", help="comma-separated block sizes (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--cpu", type=int, help="core to pin to (default: the last one this process may use)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per figure (default %(default)s)")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per timed run (default %(default)s)")
    args = parser.parse_args()
    cpu = max(os.sched_getaffinity(0)) if args.cpu is None else args.cpu
    os.sched_setaffinity(0, {cpu})
    rows = [r for size in args.sizes for r in bench_size(size, args.repeat, args.min_time)]
    if args.json:
        print(json.dumps({"cpu": cpu, "results": rows}, indent=2))
    else:
        print_table(rows, cpu)


if __name__ == "__main__":
    main()
