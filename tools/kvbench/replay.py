"""``kvbench replay TRACE``: replay a request trace against a simulated store (``tools.replay``) or, with
``--mode live``, against the running cluster of ``kvbench --config PATH`` (``tools.replay_live``).

The simulated store's capacity is ``--capacity-tokens`` (a bare LRU of that many tokens), or a cluster's, as its
nodes enforce it (``tools.capacity``: erasure coding, slot rounding, per-primary budgets): the cluster file of
``kvbench --config PATH`` or ``--node-capacity SIZE`` (``--nodes`` like ``kvstore init``), for blocks of
``--block-tokens × --bytes-per-token``, with that cluster's ``[gc]`` watermarks unless ``--watermarks`` is given,
one LRU over the whole cluster or, with ``--per-primary``, one per primary. Live replay reports the same capacity
for its cluster."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
from pathlib import Path
from typing import Any

from kvtier.kvstore.client import Client
from kvtier.kvstore.units import format_duration, format_size, parse_duration, parse_size
from kvtier.kvstore.wire.transport import AuthError
from kvtier.tools.capacity import Capacity, cluster_capacity, local_capacity
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import UsageError, cluster_config
from kvtier.tools.replay import ReplayResult, replay
from kvtier.tools.replay_live import replay_live
from kvtier.tools.traces import DEFAULT_BLOCK_TOKENS, DEFAULT_TTL_CLASS, Request, TraceError, load_trace


def register(commands: Subcommands) -> None:
    parser = commands.add("replay", "replay a request trace against a simulated store or a running cluster", run_replay)
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
    parser.add_argument(
        "--node-capacity",
        metavar="SIZE",
        help="sim: a cluster of --nodes nodes of SIZE each (as `kvstore init` writes it); its real block capacity",
    )
    parser.add_argument("--nodes", type=int, default=12, help="with --node-capacity: nodes (a multiple of 12)")
    parser.add_argument(
        "--one-lru",
        action="store_true",
        help="sim with a cluster's capacity: one LRU over every primary's blocks, instead of one per primary (faster, "
        "and optimistic where primaries hold few blocks: it ignores that each fills on its own)",
    )
    parser.add_argument(
        "--salt",
        metavar="HEX",
        help="salt of the blocks' keys, which decides their primaries: give sim and live the same to compare them "
        "(default: none in sim, random in live)",
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
    parser.add_argument(
        "--watermarks",
        metavar="HIGH,LOW",
        help="GC hysteresis, e.g. 0.9,0.8 (default: the cluster's with --config/--node-capacity, else plain LRU)",
    )
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


def _parse_salt(text: str | None) -> bytes | None:
    if text is None:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise UsageError(f"--salt {text!r}: use hex digits, e.g. 5a17") from None


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
        "per_primary": not args.one_lru,
        "salt": _parse_salt(args.salt),
    }


def run_replay(args: argparse.Namespace) -> int:
    """Run the replay that ``args`` describes; returns the exit status (0).

    Raises UsageError (one line) for a bad option value, a missing or unreadable trace, an invalid trace line (its
    line number is named), or ``--mode live`` without a reachable cluster (``kvbench --config PATH replay ...``)
    or with simulation-only options.
    Output goes to stdout: a table, or with ``--json`` one object (top level: ``token_hit_ratio``,
    ``block_hit_ratio``, ``ideal_token_hit_ratio``, ``evictions``, ``requests``, the other :class:`ReplayResult`
    fields and the settings; with ``--sweep``: ``{"sweep": [one such object per capacity], "csv", "plot"}``).
    """
    try:
        options = _parse_args(args)
        if args.mode == "live":
            return _run_live(args, options)
        options["store"] = _store_capacity(args, options)
        if args.sweep is not None:
            capacities = [_parse_capacity(part, "--sweep") for part in args.sweep.split(",") if part.strip()]
            if not capacities:
                raise UsageError("--sweep needs at least one capacity, e.g. 1000000,10000000,inf")
        else:
            capacities = [None if options["store"] else _parse_capacity(args.capacity_tokens, "--capacity-tokens")]
        try:
            requests = load_trace(args.trace)
        except FileNotFoundError:
            raise UsageError(f"trace file not found: {args.trace}") from None
        except OSError as exc:
            raise UsageError(f"cannot read trace {args.trace}: {exc.strerror or exc}") from None
        results = _run_all(requests, capacities, options, show_progress=not args.json)
    except (TraceError, ValueError) as exc:
        raise UsageError(str(exc)) from None

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
        raise UsageError(f"cannot write to {args.out}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps({"sweep": rows, "csv": str(csv_path), "plot": str(plot_path) if plot_path else None}))
    else:
        _print_table(rows, args.trace, options)
        print(f"wrote {csv_path}" + (f" and {plot_path}" if plot_path else " (install matplotlib for a plot)"))
    return 0


def _store_capacity(args: argparse.Namespace, options: dict[str, Any]) -> Capacity | None:
    """The cluster capacity a sim replay uses (``--config`` or ``--node-capacity``), or None for
    ``--capacity-tokens``; UsageError for options that contradict each other."""
    config_path = getattr(args, "config", None)
    if config_path is None and args.node_capacity is None:
        if args.one_lru:
            raise UsageError("--one-lru goes with a cluster's capacity (kvbench --config PATH, or --node-capacity)")
        options["per_primary"] = False
        return None
    if config_path is not None and args.node_capacity is not None:
        raise UsageError("give --node-capacity or kvbench --config PATH, not both")
    given = [name for name, on in (("--capacity-tokens", _finite(args)), ("--sweep", args.sweep is not None)) if on]
    if given:
        raise UsageError(f"{', '.join(given)}: the capacity is the cluster's (--config or --node-capacity)")
    block_bytes = options["block_tokens"] * options["bytes_per_token"]
    if not block_bytes:
        raise UsageError("a cluster's capacity depends on the block's size: give --bytes-per-token, e.g. 64KiB")
    try:
        if config_path is not None:
            return cluster_capacity(cluster_config(args), block_bytes)
        return local_capacity(parse_size(args.node_capacity), block_bytes, args.nodes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _finite(args: argparse.Namespace) -> bool:
    return args.capacity_tokens.strip().lower() != "inf"


def _run_live(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``--mode live``: the running cluster's own capacity, watermarks and TTLs decide (tools.replay_live)."""
    config_path = getattr(args, "config", None)
    if config_path is None:
        raise UsageError("--mode live drives a running cluster: kvbench --config PATH replay TRACE --mode live")
    simulated = [
        name
        for name, given in (
            ("--sweep", args.sweep is not None),
            ("--capacity-tokens", _finite(args)),
            ("--node-capacity", args.node_capacity is not None),
            ("--one-lru", args.one_lru),
            ("--watermarks", args.watermarks is not None),
            ("--ttl", bool(args.ttl)),
        )
        if given
    ]
    if simulated:
        raise UsageError(f"{', '.join(simulated)}: --mode live uses the cluster's own capacity, watermarks and TTLs")
    config = cluster_config(args)
    try:
        requests = load_trace(args.trace)
    except FileNotFoundError:
        raise UsageError(f"trace file not found: {args.trace}") from None
    try:
        with Client(config) as client:
            block_tokens, bytes_per_token = options["block_tokens"], options["bytes_per_token"]
            result = replay_live(requests, client, block_tokens, bytes_per_token, salt=options["salt"])
    except AuthError as exc:
        raise UsageError(f"the cluster rejected the token in {config_path}: {exc}") from None
    store = cluster_capacity(config, options["block_tokens"] * options["bytes_per_token"])
    options = {**options, "store": store, "watermarks": store.watermarks}
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
            results.append(replay(stream, capacity_tokens=capacity, **{**options, "salt": options["salt"] or b""}))
        return results


def _row(trace: str, capacity: int | None, options: dict[str, Any], result: ReplayResult) -> dict[str, Any]:
    store = options.get("store")
    watermarks = options["watermarks"] or (store.watermarks if store else None)
    return {
        **result.to_dict(),
        "trace": trace,
        "mode": "sim",
        "capacity_tokens": capacity if store is None else store.blocks * options["block_tokens"],
        "store": store.to_dict() if store else None,
        "per_primary": bool(options.get("per_primary")),
        "block_tokens": options["block_tokens"],
        "watermarks": list(watermarks) if watermarks else None,
        "ttl_s": options["ttl"],
        "bytes_per_token": options["bytes_per_token"],
    }


_TABLE_COLUMNS = (  # (result key, row name for one run, column header for a sweep)
    ("capacity_tokens", "capacity (tokens)", "capacity"),
    ("capacity_blocks", "capacity (blocks)", "blocks"),
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
    if rows[0]["watermarks"]:
        settings.append("watermarks {:g}/{:g}".format(*rows[0]["watermarks"]))
    if options["ttl"]:
        settings.append("TTL " + ", ".join(f"{c}={format_duration(s)}" for c, s in options["ttl"].items()))
    title = f"replay ({rows[0]['mode']}) of {trace}\n" + ", ".join(settings)
    caption = None
    store = rows[0]["store"]
    if store:  # how the cluster's bytes become blocks (tools.capacity)
        lru = "an LRU per primary" if rows[0]["per_primary"] else "one LRU over them"
        caption = (
            f"{store['primaries']} primaries × {'–'.join(map(str, sorted(set(store['blocks_per_primary']))))} "
            f"blocks of {format_size(store['block_bytes'])} (12 shards of {format_size(store['shard_bytes'])} in "
            f"{format_size(store['slot_bytes'])} slots), {lru}"
        )
    columns = [c for c in _TABLE_COLUMNS if options["bytes_per_token"] or not c[0].startswith("bytes_")]
    if len(rows) == 1:
        table = Table(title=title, caption=caption)
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
