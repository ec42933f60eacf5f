"""Trace replay in simulation mode: what hit ratio a store of a given capacity, GC watermarks and TTLs would reach.

Semantics (one pass over the requests, in trace order; ``block_tokens`` tokens per block):

1. **Expiry.** With ``ttl`` set, every block of class ``c`` whose ``created + ttl[c]`` is strictly before this
   request's timestamp is removed first (as the GC worker would) and counted in ``expirations``. Trace timestamps
   are milliseconds, TTLs seconds. ``created`` is when the block was last *stored*; touching it does not extend it.
2. **Hit.** The request's hit is the longest run of its leading ``hash_ids`` that are stored;
   ``hit tokens = min(hit_blocks × block_tokens, input_length)``.
3. **Store.** Then each of its blocks, in order, is touched (if stored) or stored (counted in ``blocks_written``),
   so its last block ends up most recently used. A stored block takes the request's TTL class.
4. **Capacity.** ``capacity_tokens = N`` holds ``N // block_tokens`` blocks. Without ``watermarks`` the least
   recently used block is evicted as soon as one more is needed. With ``watermarks=(high, low)`` the GC's
   hysteresis is modelled after every store: if the block count passes ``high × capacity_blocks``, least recently
   used blocks go until it is ``<= low × capacity_blocks`` (:func:`kvtier.gc.policy.plan_eviction`, block counts as
   sizes); a store that would still exceed the capacity first evicts one block. Usage never passes the capacity.
   A block evicted or expired and later stored again is a new store. A capacity under one block stores nothing.

``ideal_token_hit_ratio`` is the same trace with infinite capacity and no TTL (the trace's reuse ceiling).
``--mode live`` replays the same semantics against a running cluster instead (``tools.replay_live``).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.gc.policy import LruIndex, plan_eviction
from kvtier.kvstore.units import format_duration, format_size, parse_duration, parse_size
from kvtier.tools.traces import DEFAULT_BLOCK_TOKENS, DEFAULT_TTL_CLASS, Request, TraceError, load_trace

PROG = "replay"


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Counts from one replay. Ratios are 0.0 when their denominator is 0. Bytes count whole blocks:
    ``bytes_written = blocks_written × block_tokens × bytes_per_token``, ``bytes_read`` likewise for hit blocks.
    ``capacity_blocks`` is None for infinite capacity; ``max_blocks_stored`` is the peak occupancy, never above it."""

    requests: int
    token_hit_ratio: float
    block_hit_ratio: float
    ideal_token_hit_ratio: float
    evictions: int
    expirations: int
    blocks_written: int
    blocks_read: int
    bytes_written: int
    bytes_read: int
    input_tokens: int
    hit_tokens: int
    ideal_hit_tokens: int
    total_blocks: int
    capacity_blocks: int | None
    max_blocks_stored: int
    blocks_stored_at_end: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_counts(
        cls,
        *,
        requests: int,
        input_tokens: int,
        hit_tokens: int,
        ideal_hit_tokens: int,
        total_blocks: int,
        hit_blocks: int,
        written: int,
        block_bytes: int,
        evictions: int,
        expirations: int,
        capacity_blocks: int | None,
        max_blocks_stored: int,
        blocks_stored_at_end: int,
    ) -> ReplayResult:
        """The result from raw counts (ratios and bytes derived here, once for every replay mode)."""
        return cls(
            requests=requests,
            token_hit_ratio=hit_tokens / input_tokens if input_tokens else 0.0,
            block_hit_ratio=hit_blocks / total_blocks if total_blocks else 0.0,
            ideal_token_hit_ratio=ideal_hit_tokens / input_tokens if input_tokens else 0.0,
            evictions=evictions,
            expirations=expirations,
            blocks_written=written,
            blocks_read=hit_blocks,
            bytes_written=written * block_bytes,
            bytes_read=hit_blocks * block_bytes,
            input_tokens=input_tokens,
            hit_tokens=hit_tokens,
            ideal_hit_tokens=ideal_hit_tokens,
            total_blocks=total_blocks,
            capacity_blocks=capacity_blocks,
            max_blocks_stored=max_blocks_stored,
            blocks_stored_at_end=blocks_stored_at_end,
        )


def replay(
    requests: Iterable[Request | Mapping[str, Any]],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    capacity_tokens: int | None = None,
    watermarks: tuple[float, float] | None = None,
    ttl: Mapping[str, float] | None = None,
    bytes_per_token: int = 0,
) -> ReplayResult:
    """Replay ``requests`` (Request objects or decoded trace lines) against a simulated store; see the module doc.

    ``capacity_tokens`` None is infinite (``watermarks`` are then ignored). ``watermarks`` is ``(high, low)`` with
    ``0 < low <= high <= 1``. ``ttl`` maps TTL class → seconds; None means nothing expires, and when it is given
    every class the trace uses must be in it. Raises ValueError for bad arguments, a request of a class ``ttl``
    does not define, or a timestamp earlier than the one before it (TraceError for an invalid decoded line).
    Time: O(total blocks), about a second per million blocks; memory: O(distinct blocks).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if capacity_tokens is not None and capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must not be negative, got {capacity_tokens}")
    if bytes_per_token < 0:
        raise ValueError(f"bytes_per_token must not be negative, got {bytes_per_token}")
    cap = None if capacity_tokens is None else capacity_tokens // block_tokens
    high = low = 0.0
    if watermarks is not None:
        high, low = watermarks
        if not 0 < low <= high <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low <= high <= 1, got high={high} low={low}")
    use_watermarks = watermarks is not None and cap is not None
    high_blocks = high * cap if cap is not None else 0.0
    ttl_ms: dict[str, float] = {}
    for cls, seconds in (ttl or {}).items():
        if not seconds > 0:
            raise ValueError(f"TTL of class {cls!r} must be positive, got {seconds}")
        ttl_ms[cls] = seconds * 1000.0
    # Per class, (expires_at, key, created) in store order; with time-ordered requests and one TTL per class this
    # is expiry order, so expiry is a pop from the left. Entries of blocks since evicted or re-stored are stale.
    expiry: dict[str, deque[tuple[float, int, float]]] = {cls: deque() for cls in ttl_ms}

    index = LruIndex()
    contains, touch, insert, remove, pop_lru, get = (
        index.__contains__, index.touch, index.insert, index.remove, index.pop_lru, index.get
    )  # fmt: skip
    seen: set[int] = set()
    n = input_tokens = hit_tokens = ideal_hit_tokens = total_blocks = hit_blocks = 0
    evictions = expirations = written = max_stored = 0
    last_ts = -math.inf

    for n, request in enumerate(requests, 1):
        if not isinstance(request, Request):
            request = Request.from_dict(request)
        now = request.timestamp
        if now < last_ts:
            raise ValueError(f"request #{n}: timestamp {now} is earlier than the one before ({last_ts})")
        last_ts = now
        cls = request.ttl_class or DEFAULT_TTL_CLASS
        queue = None
        if ttl_ms:
            queue = expiry.get(cls)
            if queue is None:
                raise ValueError(f"request #{n} has TTL class {cls!r}, which has no TTL; give every class one")
            for qcls, q in expiry.items():
                while q and q[0][0] < now:
                    _, key, created = q.popleft()
                    entry = get(key)
                    if entry is not None and entry.created == created and entry.ttl_class == qcls:
                        remove(key)
                        expirations += 1

        ids = request.hash_ids
        length = request.input_length
        hit = 0
        for h in ids:
            if not contains(h):
                break
            hit += 1
        ideal = 0
        for h in ids:
            if h not in seen:
                break
            ideal += 1
        seen.update(ids)
        input_tokens += length
        hit_tokens += min(hit * block_tokens, length)
        ideal_hit_tokens += min(ideal * block_tokens, length)
        hit_blocks += hit
        total_blocks += len(ids)

        for h in ids:
            if touch(h, now):
                continue
            if cap is not None:
                if cap == 0:
                    continue
                if len(index) >= cap:
                    pop_lru()
                    evictions += 1
            insert(h, 1, now, cls)
            written += 1
            if queue is not None:
                queue.append((now + ttl_ms[cls], h, now))
            stored = len(index)
            if stored > max_stored:
                max_stored = stored
            if use_watermarks and stored > high_blocks:
                victims = plan_eviction(stored, cap, high, low, index.lru_sizes())
                for key in victims:
                    remove(key)
                evictions += len(victims)

    block_bytes = block_tokens * bytes_per_token
    return ReplayResult.from_counts(
        requests=n,
        input_tokens=input_tokens,
        hit_tokens=hit_tokens,
        ideal_hit_tokens=ideal_hit_tokens,
        total_blocks=total_blocks,
        hit_blocks=hit_blocks,
        written=written,
        block_bytes=block_bytes,
        evictions=evictions,
        expirations=expirations,
        capacity_blocks=cap,
        max_blocks_stored=max_stored,
        blocks_stored_at_end=len(index),
    )


# --- command line -------------------------------------------------------------------------------------------------


class UsageError(ValueError):
    """A bad command-line value; its message is the one line shown to the user."""


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the replay options on ``parser`` (or a subparser); values are validated by :func:`run_replay`."""
    parser.add_argument("trace", metavar="TRACE", help="trace file, Mooncake JSONL")
    parser.add_argument(
        "--mode",
        choices=("sim", "live"),
        default="sim",
        help="sim: the store's index and eviction policy in one process, no payloads (default); "
        "live: drive the running cluster of kvbench --config with real payloads of --bytes-per-token",
    )
    parser.add_argument(
        "--capacity-tokens", default="inf", metavar="N|inf", help="store capacity in tokens (default: inf)"
    )
    parser.add_argument("--block-tokens", default=str(DEFAULT_BLOCK_TOKENS), metavar="N", help="tokens per block")
    parser.add_argument(
        "--ttl",
        action="append",
        default=[],
        metavar="CLASS=DURATION",
        help="TTL of a class, e.g. chatbot=7d (repeatable; default: no expiry). Requests without a ttl_class are "
        f"{DEFAULT_TTL_CLASS!r}",
    )
    parser.add_argument("--watermarks", metavar="HIGH,LOW", help="GC hysteresis, e.g. 0.9,0.8 (default: plain LRU)")
    parser.add_argument(
        "--bytes-per-token", default="0", metavar="SIZE", help="KV bytes per token for bytes moved, e.g. 70KiB"
    )
    parser.add_argument(
        "--sweep", metavar="CAP1,CAP2,...", help="replay at each capacity (tokens or inf); write CSV and plot"
    )
    parser.add_argument("--out", default=".", metavar="DIR", help="where --sweep writes sweep.csv, sweep.png")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _parse_capacity(text: str, option: str) -> int | None:
    if text.strip().lower() in ("inf", "infinite", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{option} {text!r}: use a whole number of tokens or 'inf'") from None
    if value < 0:
        raise UsageError(f"{option} {text!r}: must not be negative")
    return value


def _parse_watermarks(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        high, low = (float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--watermarks {text!r}: use HIGH,LOW, e.g. 0.9,0.8") from None
    if not 0 < low <= high <= 1:
        raise UsageError(f"--watermarks {text!r}: need 0 < LOW <= HIGH <= 1")
    return high, low


def _parse_ttls(items: list[str]) -> dict[str, float] | None:
    ttl: dict[str, float] = {}
    for item in items:
        cls, sep, duration = item.partition("=")
        if not sep or not cls.strip():
            raise UsageError(f"--ttl {item!r}: use CLASS=DURATION, e.g. chatbot=7d")
        try:
            ttl[cls.strip()] = parse_duration(duration)
        except ValueError as exc:
            raise UsageError(f"--ttl {item!r}: {exc}") from None
    return ttl or None


def _parse_args(args: argparse.Namespace) -> dict[str, Any]:
    try:
        block_tokens = int(args.block_tokens)
    except ValueError:
        raise UsageError(f"--block-tokens {args.block_tokens!r}: use a positive whole number") from None
    if block_tokens <= 0:
        raise UsageError(f"--block-tokens {args.block_tokens!r}: must be positive")
    try:
        bytes_per_token = parse_size(args.bytes_per_token)
    except ValueError as exc:
        raise UsageError(f"--bytes-per-token: {exc}") from None
    return {
        "block_tokens": block_tokens,
        "watermarks": _parse_watermarks(args.watermarks),
        "ttl": _parse_ttls(args.ttl),
        "bytes_per_token": bytes_per_token,
    }


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run_replay(args: argparse.Namespace) -> int:
    """Run the replay that ``args`` (from :func:`add_replay_arguments`) describes; returns the exit status.

    0 on success. 2, with one ``replay: error: ...`` line on stderr and no traceback, for a bad option value,
    a missing or unreadable trace, an invalid trace line (its line number is named), or ``--mode live``
    without a reachable cluster (``kvbench --config PATH replay ...``) or with simulation-only options.
    Output goes to stdout: a table, or with ``--json`` one object (top level: ``token_hit_ratio``,
    ``block_hit_ratio``, ``ideal_token_hit_ratio``, ``evictions``, ``requests``, the other :class:`ReplayResult`
    fields and the settings; with ``--sweep``: ``{"sweep": [one such object per capacity], "csv", "plot"}``).
    """
    try:
        options = _parse_args(args)
        if args.mode == "live":
            return _run_live(args, options)
        if args.sweep is not None:
            capacities = [_parse_capacity(part, "--sweep") for part in args.sweep.split(",") if part.strip()]
            if not capacities:
                raise UsageError("--sweep needs at least one capacity, e.g. 1000000,10000000,inf")
        else:
            capacities = [_parse_capacity(args.capacity_tokens, "--capacity-tokens")]
        try:
            requests = load_trace(args.trace)
        except FileNotFoundError:
            raise UsageError(f"trace file not found: {args.trace}") from None
        except OSError as exc:
            raise UsageError(f"cannot read trace {args.trace}: {exc.strerror or exc}") from None
        results = _run_all(requests, capacities, options, show_progress=not args.json)
    except (UsageError, TraceError, ValueError) as exc:
        return _error(str(exc))

    rows = [_row(args.trace, capacity, options, result) for capacity, result in zip(capacities, results, strict=True)]
    if args.sweep is None:
        if args.json:
            print(json.dumps(rows[0]))
        else:
            _print_table(rows, args.trace, options)
        return 0
    try:
        csv_path, plot_path = _write_sweep(Path(args.out), rows)
    except OSError as exc:
        return _error(f"cannot write to {args.out}: {exc.strerror or exc}")
    if args.json:
        print(json.dumps({"sweep": rows, "csv": str(csv_path), "plot": str(plot_path) if plot_path else None}))
    else:
        _print_table(rows, args.trace, options)
        print(f"wrote {csv_path}" + (f" and {plot_path}" if plot_path else " (install matplotlib for a plot)"))
    return 0


def _run_live(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``--mode live``: the running cluster's own capacity, watermarks and TTLs decide (tools.replay_live)."""
    from kvtier.kvstore import cluster as cluster_mod
    from kvtier.kvstore.client import Client
    from kvtier.kvstore.transport import AuthError
    from kvtier.tools.replay_live import replay_live

    config_path = getattr(args, "config", None)
    if config_path is None:
        raise UsageError("--mode live drives a running cluster: kvbench --config PATH replay TRACE --mode live")
    simulated = [
        name
        for name, given in (
            ("--sweep", args.sweep is not None),
            ("--capacity-tokens", args.capacity_tokens.strip().lower() != "inf"),
            ("--watermarks", args.watermarks is not None),
            ("--ttl", bool(args.ttl)),
        )
        if given
    ]
    if simulated:
        raise UsageError(f"{', '.join(simulated)}: --mode live uses the cluster's own capacity, watermarks and TTLs")
    try:
        config = cluster_mod.load(config_path)
        requests = load_trace(args.trace)
    except FileNotFoundError:
        raise UsageError(f"trace file not found: {args.trace}") from None
    except cluster_mod.ConfigError as exc:
        raise UsageError(str(exc)) from None
    try:
        with Client(config) as client:
            result = replay_live(requests, client, options["block_tokens"], options["bytes_per_token"])
    except AuthError as exc:
        raise UsageError(f"the cluster rejected the token in {config_path}: {exc}") from None
    row = {**_row(args.trace, None, options, result), "mode": "live", "cluster": str(config_path)}
    if args.json:
        print(json.dumps(row))
    else:
        _print_table([row], args.trace, options)
    return 0


def _run_all(
    requests: list[Request], capacities: list[int | None], options: dict[str, Any], show_progress: bool
) -> list[ReplayResult]:
    """One replay per capacity; a rich progress bar on stderr when it is a terminal and ``show_progress``."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    with Progress(console=console, disable=not (show_progress and console.is_terminal), transient=True) as progress:
        results = []
        for capacity in capacities:
            label = "inf" if capacity is None else f"{capacity:,}"
            stream = progress.track(requests, description=f"replay, capacity {label} tokens")
            results.append(replay(stream, capacity_tokens=capacity, **options))
        return results


def _row(trace: str, capacity: int | None, options: dict[str, Any], result: ReplayResult) -> dict[str, Any]:
    watermarks = options["watermarks"]
    return {
        **result.to_dict(),
        "trace": trace,
        "mode": "sim",
        "capacity_tokens": capacity,
        "block_tokens": options["block_tokens"],
        "watermarks": list(watermarks) if watermarks else None,
        "ttl_s": options["ttl"],
        "bytes_per_token": options["bytes_per_token"],
    }


_TABLE_COLUMNS = (  # (result key, row name for one run, column header for a sweep)
    ("capacity_tokens", "capacity (tokens)", "capacity"),
    ("token_hit_ratio", "token hit ratio", "tok hit"),
    ("block_hit_ratio", "block hit ratio", "blk hit"),
    ("ideal_token_hit_ratio", "ideal token hit ratio", "ideal"),
    ("evictions", "evictions", "evicted"),
    ("expirations", "expirations", "expired"),
    ("blocks_written", "blocks written", "written"),
    ("blocks_read", "blocks read (hits)", "read"),
    ("bytes_written", "bytes written", "B written"),
    ("bytes_read", "bytes read", "B read"),
)


def _cell(key: str, value: Any, compact: bool) -> str:
    if value is None:
        return "inf"
    if key.endswith("_ratio"):
        return f"{value:.2%}"
    if key.startswith("bytes_"):
        return format_size(value)
    if compact and value >= 10_000:
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if value >= scale:
                return f"{value / scale:.3g}{suffix}"
    return f"{value:,}"


def _print_table(rows: list[dict[str, Any]], trace: str, options: dict[str, Any]) -> None:
    """One run: a metric/value table. A sweep: one row per capacity, numbers compacted to fit a terminal."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    settings = [f"{rows[0]['requests']:,} requests", f"{options['block_tokens']}-token blocks"]
    if options["watermarks"]:
        settings.append("watermarks {:g}/{:g}".format(*options["watermarks"]))
    if options["ttl"]:
        settings.append("TTL " + ", ".join(f"{c}={format_duration(s)}" for c, s in options["ttl"].items()))
    title = f"replay (sim) of {trace}\n" + ", ".join(settings)
    columns = [c for c in _TABLE_COLUMNS if options["bytes_per_token"] or not c[0].startswith("bytes_")]
    if len(rows) == 1:
        table = Table(title=title)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, name, _ in columns:
            table.add_row(name, _cell(key, rows[0][key], compact=False))
    else:  # bytes are in the CSV; leaving them out keeps the table within 80 columns
        table = Table(title=title, box=box.SIMPLE_HEAD)
        columns = [c for c in columns if not c[0].startswith("bytes_") and (options["ttl"] or c[0] != "expirations")]
        for _, _, header in columns:
            table.add_column(header, justify="right")
        for row in rows:
            table.add_row(*(_cell(key, row[key], compact=True) for key, _, _ in columns))
    Console().print(table)


_CSV_FIELDS = (
    "capacity_tokens", "capacity_blocks", "token_hit_ratio", "block_hit_ratio", "ideal_token_hit_ratio",
    "evictions", "expirations", "blocks_written", "blocks_read", "bytes_written", "bytes_read", "requests",
    "max_blocks_stored",
)  # fmt: skip


def _write_sweep(out: Path, rows: list[dict[str, Any]]) -> tuple[Path, Path | None]:
    """Write ``out/sweep.csv`` (capacity ``inf`` for infinite) and, with matplotlib, ``out/sweep.png``."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "sweep.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(_CSV_FIELDS)
        for row in rows:
            writer.writerow(["inf" if row[k] is None and k.startswith("capacity") else row[k] for k in _CSV_FIELDS])
    if importlib.util.find_spec("matplotlib") is None:
        return csv_path, None
    plot_path = out / "sweep.png"
    _plot_sweep(plot_path, rows)
    return csv_path, plot_path


def _plot_sweep(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted((r["capacity_tokens"], r["token_hit_ratio"]) for r in rows if r["capacity_tokens"] is not None)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if finite:
        xs, ys = zip(*finite, strict=True)
        ax.plot(xs, ys, marker="o", label="token hit ratio")
        if min(xs) > 0 and max(xs) > 10 * min(xs):
            ax.set_xscale("log")
    ideal = rows[0]["ideal_token_hit_ratio"]
    infinite = [r["token_hit_ratio"] for r in rows if r["capacity_tokens"] is None]
    if infinite and infinite[0] != ideal:  # only TTL can keep an infinite store below the ideal
        ax.axhline(infinite[0], color="tab:green", linestyle=":", label="infinite capacity, with TTL")
    ax.axhline(ideal, color="tab:gray", linestyle="--", label="ideal (no capacity limit, no TTL)")
    ax.set_xlabel("capacity (tokens)")
    ax.set_ylabel("token hit ratio")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(Path(rows[0]["trace"]).name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry until kvbench wires this in: ``python -m kvtier.tools.replay TRACE [options]``."""
    parser = argparse.ArgumentParser(prog=PROG, description="Replay a Mooncake-format trace against a simulated store.")
    add_replay_arguments(parser)
    return run_replay(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
