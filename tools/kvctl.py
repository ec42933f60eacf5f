"""``kvctl``: the operator's command line for a running kvtier cluster.

    kvctl [--config PATH] [--token TOKEN] [--json] [--timeout S] COMMAND ...

    status                                   cluster summary: nodes up/down, capacity, usage, blocks, codec, TTLs
    nodes                                    per node: address, state, usage, shards, blocks, GC state
    stat KEYHEX                              where a block's 12 shards live, its size, class and times
    match --tokens FILE --model M --dtype D --block-tokens N --layout L [--salt S]
                                             how many leading blocks of a token file are stored
    ttl show                                 the TTL table (cluster file and nodes) and blocks per class
    ttl set CLASS DURATION                   change a class's TTL (applies to blocks already stored)
    ttl add CLASS DURATION                   add a class
    ttl remove CLASS [--force]               remove a class no block uses
    evict [--class C] [--older-than D] [--dry-run]
                                             remove blocks of a class and/or created longer ago than D
    gc run [--repair]                        one GC cycle on every node now; per-node GC stats
    repair                                   restore every block's 12 shards (a GC cycle with repair, all nodes)
    drain NODE [--undo]                      stop NODE taking new shards, repair the others, say when it can go
    top [--interval S] [--count N]           live node usage and request rates (Ctrl-C leaves)

The cluster file comes from ``--config`` or ``$KVTIER_CONFIG``; the token defaults to the cluster file's
``[cluster] token`` (the admin). Every command except ``stat`` and ``match`` needs the admin token: the nodes
refuse the rest to a tenant. Global options may also follow the command (``kvctl status --json``).

**Output.** Tables for people; with ``--json`` every command prints one JSON object (``top``: one per refresh,
one per line) and nothing else on stdout.

**TTL changes** (``ttl set/add/remove``) rewrite only the ``[ttl]`` table's affected line of the cluster file
(every other line stays as it is; written to a temporary file in the same folder, fsynced, then renamed over the
file, under a lock on the folder), then push the whole new table to every node (admin ``ttl_set``). A node that
is down reads the file when it starts. ``ttl remove`` is refused while any node is primary for blocks of the
class, for the last class, and while a node is down (its blocks cannot be counted; ``--force`` removes anyway:
that node's blocks of the class stop being served when it restarts).

**Repair** counts are shard writes, summed over nodes: a block's primary and shard 1's node both hold its
record and both repair it, so a shard missing when both look may be written (and counted) twice.

**Draining** (``drain NODE``): the node stops taking new shards (puts of blocks whose primary it is are refused
meanwhile, as for a down primary), then every other node runs a GC cycle with repair, so each block has its
other 11 shards. It is safe to stop the node when no other node of its placement group is down and every other
node finished its repair; kvctl says which. The flag lives in the node process only: a restarted node takes
shards again. After replacing the node, ``kvctl repair`` rewrites its shards.

Exit status:

- 0: done.
- 1: refused or incomplete: ``ttl remove`` of a class in use, of the last class, or with a node down; ``stat``
  of a key with no block record; ``drain`` when it is not yet safe to stop the node; an admin action that a node
  answered with an error other than being down. One ``kvctl: ...`` line on stderr says why.
- 2: a usage error: bad option, unknown class, bad duration, bad key hex, a missing or invalid cluster file, no
  node reachable, a tenant token on an admin command, a token the nodes reject. One ``kvctl: ...`` line on
  stderr says what to do; never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import stat as stat_mod
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

PROG = "kvctl"
ENV_CONFIG = "KVTIER_CONFIG"
LONG_TIMEOUT_S = 600.0  # gc/repair/drain: a node answers when its cycle (rate-limited repair) is done
SHARD_STATES = {1: "pending", 2: "committed"}
DATA_SHARDS = 10

# --- errors ---------------------------------------------------------------------------------------------------


class UserError(Exception):
    """Something the user can fix (exit status 2)."""


class Refused(Exception):
    """The cluster refused, or the command could not complete (exit status 1)."""


# --- small helpers --------------------------------------------------------------------------------------------


def _rel(seconds: float) -> str:
    """``3d4h``, ``5m``, ``12s``: a compact span."""
    seconds = abs(seconds)
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            parts.append(f"{int(seconds // size)}{unit}")
            seconds %= size
        if len(parts) == 2:
            break
    return "".join(parts)


def _when(ts: float | None, now: float | None = None) -> str:
    """An absolute local time and how far from now it is: ``2025-06-01 12:00:03 (5m ago)``."""
    if ts is None:
        return "-"
    now = time.time() if now is None else now
    stamp = datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    delta = ts - now
    return f"{stamp} ({'in ' + _rel(delta) if delta > 0 else _rel(delta) + ' ago'})"


def _pct(used: float, capacity: float) -> float:
    return used / capacity if capacity else 0.0


def _size(n: float) -> str:
    from kvtier.kvstore.units import format_size

    return format_size(n)


def _duration(text: str) -> float:
    from kvtier.kvstore.units import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _fmt_duration(seconds: float) -> str:
    from kvtier.kvstore.units import format_duration

    return format_duration(seconds)


# --- the cluster and its nodes --------------------------------------------------------------------------------


class Ctl:
    """One invocation: the parsed options, the cluster file, a client (opened on first use), the output."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.json: bool = args.json
        if args.timeout is not None and not (args.timeout > 0 and math.isfinite(args.timeout)):
            raise UserError(f"--timeout must be a positive number of seconds, got {args.timeout}")
        path = args.config or os.environ.get(ENV_CONFIG)
        if not path:
            raise UserError(f"no cluster file: pass --config PATH or set {ENV_CONFIG}")
        self.path = Path(path)
        self.config = self._load(self.path)
        self._client: Any = None
        self._console: Any = None
        self.command = args.command + (f" {args.action}" if getattr(args, "action", None) else "")

    @staticmethod
    def _load(path: Path) -> Any:
        from kvtier.kvstore import cluster as cluster_mod

        try:
            return cluster_mod.load(path)
        except cluster_mod.ConfigError as exc:
            raise UserError(f"{exc}") from None

    @property
    def client(self) -> Any:
        if self._client is None:
            from kvtier.kvstore.client import Client

            config = self.config
            timeout = self.args.timeout
            if timeout is None and self.args.command in ("gc", "repair", "drain"):
                timeout = LONG_TIMEOUT_S
            if timeout is not None:
                config = dataclasses.replace(config, client=dataclasses.replace(config.client, op_timeout_s=timeout))
            self._client = Client(config, token=self.args.token)
        return self._client

    @property
    def console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
            self._console = Console(width=wide, highlight=False)
        return self._console

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def address(self, nid: int) -> str:
        node = self.config.nodes[nid]
        return f"{node.host}:{node.port}"

    # -- per-node replies ------------------------------------------------------------------------------------

    def unreachable(self) -> UserError:
        return UserError(
            f"no node of the cluster in {self.path} answers ({len(self.config.nodes)} nodes, e.g. "
            f"{self.address(min(self.config.nodes))}): start them (`kvstore serve {self.path}`) or check the file"
        )

    def forbidden(self) -> UserError:
        return UserError(
            f"`{self.command}` needs the cluster (admin) token and the nodes refused this one: "
            f"leave out --token to use the cluster file's [cluster] token"
        )

    def sort(self, replies: dict[int, dict[str, Any]]) -> tuple[dict[int, dict], list[int], dict[int, str]]:
        """Split per-node replies into answers, nodes that are down, and other failures.

        Raises UserError when the token is not the admin's, or when no node answered at all.
        """
        ok: dict[int, dict[str, Any]] = {}
        down: list[int] = []
        failed: dict[int, str] = {}
        for nid, reply in sorted(replies.items()):
            error = reply.get("error") if set(reply) == {"error"} else None
            if error is None:
                ok[nid] = reply
            elif error == "down":
                down.append(nid)
            elif "admin" in str(error):
                raise self.forbidden()
            else:
                failed[nid] = "no answer in time" if error == "timeout" else str(error)
        if not ok:
            if all(failed.get(n) in (None, "no answer in time") for n in replies):
                raise self.unreachable()
            raise Refused("no node answered: " + "; ".join(f"node {n}: {why}" for n, why in failed.items()))
        return ok, down, failed

    def infos(self) -> tuple[dict[int, dict], list[int], dict[int, str]]:
        return self.sort(self.client.node_info())

    def ensure_reachable(self) -> list[int]:
        """Connect to every node (raises AuthError for a rejected token); the ids of nodes that are down."""
        pool = self.client.pool
        down = [nid for nid in sorted(self.config.nodes) if pool.get(nid, retry_now=True) is None]
        if len(down) == len(self.config.nodes):
            raise self.unreachable()
        return down

    # -- output ----------------------------------------------------------------------------------------------

    def emit(self, obj: dict[str, Any]) -> None:
        print(json.dumps(obj), flush=True)

    def print(self, *things: Any) -> None:
        self.console.print(*things)

    def warn_down(self, down: Sequence[int], failed: dict[int, str] | None = None) -> None:
        if self.json:
            return
        if down:
            self.print(f"[yellow]down:[/] node{'s' if len(down) > 1 else ''} {', '.join(map(str, down))}")
        for nid, why in (failed or {}).items():
            self.print(f"[red]node {nid}:[/] {why}")


def _table(*columns: str, title: str | None = None, right: Sequence[str] = ()) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    return table


def _primary_blocks(info: dict[str, Any]) -> int:
    return sum(int(v) for v in (info.get("classes") or {}).values())


def _state(info: dict[str, Any] | None) -> str:
    if info is None:
        return "down"
    return "draining" if info.get("draining") else "up"


# --- status, nodes ------------------------------------------------------------------------------------------


def cmd_status(ctl: Ctl) -> int:
    from kvtier.kvstore.codec import default_codec

    ok, down, failed = ctl.infos()
    cfg = ctl.config
    capacity = sum(n.capacity_bytes for n in cfg.nodes.values())
    used = sum(int(i["used_bytes"]) for i in ok.values())
    freeing = sum(int(i.get("freeing_bytes", 0)) for i in ok.values())
    by_class: dict[str, int] = {}
    for info in ok.values():
        for name, count in (info.get("classes") or {}).items():
            by_class[name] = by_class.get(name, 0) + int(count)
    first = next(iter(ok.values()))
    high = float(first.get("high_watermark", cfg.gc.high_watermark))
    low = float(first.get("low_watermark", cfg.gc.low_watermark))
    out_of_sync = sorted(nid for nid, i in ok.items() if i.get("ttl") != cfg.ttl_classes)
    draining = sorted(nid for nid, i in ok.items() if i.get("draining"))
    backend = default_codec().backend
    result = {
        "cluster": cfg.name,
        "config": str(ctl.path),
        "nodes": {
            "total": len(cfg.nodes),
            "up": len(ok),
            "down": down,
            "draining": draining,
            "failed": {str(k): v for k, v in failed.items()},
        },
        "groups": len(cfg.groups),
        "capacity_bytes": capacity,
        "used_bytes": used,
        "freeing_bytes": freeing,
        "used_fraction": _pct(used, capacity),
        "watermarks": {"high": high, "low": low},
        "blocks": sum(by_class.values()),
        "blocks_by_class": by_class,
        "codec_backend": backend,
        "ttl": cfg.ttl_classes,
        "ttl_out_of_sync": out_of_sync,
    }
    if ctl.json:
        ctl.emit(result)
        return 0
    table = _table("", "", title=f"cluster {cfg.name} ({ctl.path})")
    table.show_header = False
    nodes_line = f"{len(ok)} up, {len(down)} down of {len(cfg.nodes)} ({len(cfg.groups)} placement group"
    nodes_line += "s)" if len(cfg.groups) > 1 else ")"
    if draining:
        nodes_line += f"; draining: {', '.join(map(str, draining))}"
    if down:
        nodes_line += f"; down: {', '.join(map(str, down))}"
    table.add_row("nodes", nodes_line)
    table.add_row("capacity", _size(capacity))
    table.add_row(
        "used", f"{_size(used)} ({_pct(used, capacity):.1%})" + (f", {_size(freeing)} freeing" if freeing else "")
    )
    table.add_row("watermarks", f"high {high:.0%}, low {low:.0%}")
    classes = ", ".join(f"{name} {count}" for name, count in sorted(by_class.items()))
    table.add_row("blocks", f"{sum(by_class.values())}" + (f" ({classes})" if classes else ""))
    table.add_row("codec", backend)
    ttl = ", ".join(f"{name} = {_fmt_duration(s)}" for name, s in cfg.ttl_classes.items())
    table.add_row("ttl classes", ttl)
    if out_of_sync:
        table.add_row("", f"[yellow]nodes with another TTL table: {', '.join(map(str, out_of_sync))}[/]")
    ctl.print(table)
    ctl.warn_down([], failed)
    return 0


def _node_row(nid: int, info: dict[str, Any] | None, ctl: Ctl, error: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"id": nid, "address": ctl.address(nid)}
    if info is None:
        row["state"] = "down" if error is None else "error"
        if error is not None:
            row["error"] = error
        row["capacity_bytes"] = ctl.config.nodes[nid].capacity_bytes
        return row
    gc = info.get("gc") or {}
    row.update(
        {
            "state": _state(info),
            "used_bytes": int(info["used_bytes"]),
            "freeing_bytes": int(info.get("freeing_bytes", 0)),
            "capacity_bytes": int(info["capacity_bytes"]),
            "used_fraction": _pct(info["used_bytes"], info["capacity_bytes"]),
            "shards": int(info.get("shards", 0)),
            "blocks": _primary_blocks(info),
            "records": int(info.get("blocks", 0)),
            "classes": info.get("classes") or {},
            "uptime_s": info.get("uptime_s"),
            "pid": info.get("pid"),
            "gc": {
                "cycles": gc.get("cycles", 0),
                "evictions": gc.get("evictions", 0),
                "expirations": gc.get("expirations", 0),
                "shards_repaired": gc.get("shards_repaired", 0),
                "last_error": gc.get("last_error", ""),
            }
            if info.get("gc") is not None
            else None,
        }
    )
    return row


def cmd_nodes(ctl: Ctl) -> int:
    ok, _, failed = ctl.infos()
    rows = [_node_row(nid, ok.get(nid), ctl, failed.get(nid)) for nid in sorted(ctl.config.nodes)]
    if ctl.json:
        ctl.emit({"nodes": rows})
        return 0
    table = _table(
        "node",
        "address",
        "state",
        "used",
        "capacity",
        "used %",
        "shards",
        "blocks",
        "gc cycles",
        "evictions",
        "expirations",
        "last gc error",
        right=("used", "capacity", "used %", "shards", "blocks", "gc cycles", "evictions", "expirations"),
    )
    style = {"up": "green", "draining": "yellow", "down": "red", "error": "red"}
    for row in rows:
        state = f"[{style[row['state']]}]{row['state']}[/]"
        if "used_bytes" not in row:
            table.add_row(
                str(row["id"]),
                row["address"],
                state,
                "-",
                _size(row["capacity_bytes"]),
                *["-"] * 6,
                row.get("error", ""),
            )
            continue
        gc = row["gc"] or {}
        table.add_row(
            str(row["id"]),
            row["address"],
            state,
            _size(row["used_bytes"]),
            _size(row["capacity_bytes"]),
            f"{row['used_fraction']:.1%}",
            str(row["shards"]),
            str(row["blocks"]),
            str(gc.get("cycles", "-")),
            str(gc.get("evictions", "-")),
            str(gc.get("expirations", "-")),
            str(gc.get("last_error") or ""),
        )
    ctl.print(table)
    return 0


# --- stat, match ----------------------------------------------------------------------------------------------


def _key(ctl: Ctl, text: str) -> bytes:
    length = 16 if ctl.config.hash_algo == "xxh3_128" else 32
    clean = text.strip().lower().removeprefix("0x")
    try:
        key = bytes.fromhex(clean)
    except ValueError:
        key = b""
    if len(key) != length:
        raise UserError(
            f"bad key {text!r}: expected {2 * length} hex digits (a {length}-byte {ctl.config.hash_algo} key)"
        )
    return key


def cmd_stat(ctl: Ctl) -> int:
    key = _key(ctl, ctl.args.key)
    ctl.ensure_reachable()
    info = ctl.client.stat(key)
    holders = ctl.client.placement.shard_nodes([key])[0].tolist()
    now = time.time()
    by_index: dict[int, dict[str, Any]] = {}
    down: list[int] = []
    errors: dict[int, str] = {}
    for shard in info["shards"]:
        if "error" in shard:
            if shard["error"] == "down":
                down.append(shard["node"])
            elif "admin" in str(shard["error"]):
                raise ctl.forbidden()
            else:
                errors[shard["node"]] = str(shard["error"])
            continue
        by_index[int(shard["index"])] = shard
    shards = []
    for index, nid in enumerate(holders):
        shard = by_index.get(index)
        entry: dict[str, Any] = {
            "index": index,
            "kind": "data" if index < DATA_SHARDS else "parity",
            "node": nid,
            "address": ctl.address(nid),
        }
        if shard is None:
            entry["state"] = "node down" if nid in down else ("unknown" if nid in errors else "missing")
        else:
            entry.update(
                state=SHARD_STATES.get(int(shard["state"]), str(shard["state"])),
                length=int(shard["length"]),
                crc=f"{int(shard['crc']):08x}",
                created=shard.get("created"),
            )
        shards.append(entry)
    block = info["block"]
    if block is not None:
        expires = block.get("expires")
        block = {**block, "live": expires is not None and now <= expires}
    committed = sum(1 for s in shards if s["state"] == "committed")
    result = {
        "key": info["key"],
        "primary": info["primary"],
        "primary_down": info["primary"] in down,
        "block": block,
        "shards": shards,
        "committed_shards": committed,
        "down": sorted(set(down)),
    }
    if ctl.json:
        ctl.emit(result)
    else:
        head = _table("", "")
        head.show_header = False
        head.add_row("block", info["key"])
        head.add_row("primary", f"node {info['primary']} ({ctl.address(info['primary'])})")
        if block is not None:
            state = "live" if block["live"] else ("expired" if block.get("expires") is not None else "unknown class")
            head.add_row("size", f"{_size(block['block_len'])} ({block['block_len']} bytes)")
            head.add_row("class", f"{block['ttl_class']} ({state})")
            head.add_row("created", _when(block["created"], now))
            head.add_row("last access", _when(block["last_access"], now))
            head.add_row("expires", _when(block.get("expires"), now))
        head.add_row("shards", f"{committed}/{len(holders)} committed")
        ctl.print(head)
        table = _table("index", "kind", "node", "address", "state", "length", "crc", right=("index", "length"))
        for s in shards:
            colour = "green" if s["state"] == "committed" else "yellow" if s["state"] == "pending" else "red"
            table.add_row(
                str(s["index"]),
                s["kind"],
                str(s["node"]),
                s["address"],
                f"[{colour}]{s['state']}[/]",
                str(s.get("length", "-")),
                s.get("crc", "-"),
            )
        ctl.print(table)
    if block is None:
        where = (
            f"primary node {info['primary']} is down, so its record cannot be read"
            if result["primary_down"]
            else f"no block record at primary node {info['primary']}: not stored, expired, evicted or deleted"
        )
        print(f"{PROG}: {where}", file=sys.stderr)
        return 1
    return 0


def _read_tokens(path: Path) -> Any:
    import numpy as np

    if not path.exists():
        raise UserError(f"token file {path} does not exist")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {path} as a .npy array: {exc}") from None
        tokens = np.asarray(tokens)
        if tokens.ndim == 2 and 1 in tokens.shape:
            tokens = tokens.reshape(-1)  # a (1, n) or (n, 1) array of one prompt
    else:
        try:
            words = path.read_text().split()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read token file {path}: {exc}") from None
        try:
            tokens = np.asarray([int(w) for w in words], dtype=np.int64)
        except ValueError:
            bad = next(w for w in words if not w.lstrip("-").isdigit())
            raise UserError(f"{path}: {bad!r} is not a token id (one integer per line, or a .npy array)") from None
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise UserError(f"{path}: tokens must be a one-dimensional integer array, got {tokens.dtype} {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
        raise UserError(f"{path}: token ids must be between 0 and 2^32-1")
    return tokens


def cmd_match(ctl: Ctl) -> int:
    from kvtier.kvstore.keys import Namespace, chain

    a = ctl.args
    if a.block_tokens <= 0:
        raise UserError(f"--block-tokens must be positive, got {a.block_tokens}")
    tokens = _read_tokens(Path(a.tokens))
    ns = Namespace(model_id=a.model, kv_dtype=a.dtype, block_tokens=a.block_tokens, layout=a.layout, tenant=a.salt)
    keys = chain(ns, tokens, ctl.config.hash_algo)
    down = ctl.ensure_reachable()
    hit = ctl.client.match(keys) if keys else 0
    result = {
        "tokens": int(tokens.size),
        "blocks": len(keys),
        "hit_blocks": hit,
        "hit_tokens": hit * a.block_tokens,
        "namespace": dataclasses.asdict(ns),
        "down": down,
    }
    if ctl.json:
        ctl.emit(result)
        return 0
    ctl.print(
        f"hit {hit} of {len(keys)} blocks = {hit * a.block_tokens} of {tokens.size} tokens "
        f"({a.block_tokens} tokens per block; a trailing partial block has no key)"
    )
    if down:
        ctl.print(
            f"[yellow]note:[/] nodes {', '.join(map(str, down))} are down; blocks whose primary they are read as misses"
        )
    return 0


# --- ttl --------------------------------------------------------------------------------------------------------

_HEADER = re.compile(r"^\s*\[")
_TTL_HEADER = re.compile(r"^\s*\[\s*ttl\s*\]\s*(#.*)?$")
_KEY = re.compile(r"""^(\s*)(["']?)([A-Za-z0-9_-]+)\2\s*=\s*("[^"]*"|'[^']*'|[0-9][0-9_.eE+-]*)\s*(#.*)?$""")
_CLASS_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def edit_ttl_table(text: str, action: str, name: str, value: str | None, table: dict[str, float]) -> str:
    """The cluster file ``text`` with one line of its ``[ttl]`` table set, added or removed.

    Every other line is kept byte for byte. ``table`` is the whole new table: written as a new ``[ttl]`` table
    at the end when the file has none (it used the default classes). Raises UserError when the TTL table is not
    a plain ``[ttl]`` table of ``class = "duration"`` lines.
    """
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if _TTL_HEADER.match(line)), None)
    if start is None:
        try:
            has_ttl = "ttl" in tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            has_ttl = True
        if has_ttl:
            raise UserError('cannot edit the TTL table: write it as a [ttl] table with one `class = "3d"` line each')
        tail = "" if not text or text.endswith("\n") else "\n"
        body = "".join(f'{k} = "{_fmt_duration(v)}"\n' for k, v in table.items())
        return f"{text}{tail}\n[ttl]\n{body}"
    end = next((j for j in range(start + 1, len(lines)) if _HEADER.match(lines[j])), len(lines))
    found: dict[str, int] = {}
    last = start
    for j in range(start + 1, end):
        stripped = lines[j].strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _KEY.match(lines[j].rstrip("\r\n"))
        if m is None:
            raise UserError(f'cannot edit the [ttl] table: line {j + 1} is not `class = "duration"`')
        found[m.group(3)] = j
        last = j
    newline = "\r\n" if lines[start].endswith("\r\n") else "\n"
    if action in ("set", "remove") and name not in found:
        raise UserError(f'cannot edit the [ttl] table: no plain `{name} = "duration"` line in it')
    if action == "remove":
        del lines[found[name]]
    elif action == "set":
        j = found[name]
        m = _KEY.match(lines[j].rstrip("\r\n"))
        assert m is not None
        comment = f"  {m.group(5)}" if m.group(5) else ""
        ending = lines[j][len(lines[j].rstrip("\r\n")) :]
        lines[j] = f'{m.group(1)}{m.group(2)}{name}{m.group(2)} = "{value}"{comment}{ending}'
    else:
        if not lines[last].endswith("\n"):
            lines[last] += newline
        lines.insert(last + 1, f'{name} = "{value}"{newline}')
    return "".join(lines)


def _write_atomic(path: Path, text: str) -> None:
    mode = stat_mod.S_IMODE(path.stat().st_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive lock on the cluster file's folder: two kvctl never rewrite the file at once."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _rewrite_ttl(ctl: Ctl, action: str, name: str, value: str | None) -> dict[str, float]:
    """Edit the file under the lock, check it loads with exactly the intended table, replace it; the new table."""
    from kvtier.kvstore import cluster as cluster_mod

    path = Path(os.path.realpath(ctl.path))
    try:
        with _folder_lock(path.parent):
            text = path.read_text()
            try:
                current = cluster_mod.parse(tomllib.loads(text), base_dir=path.parent, path=path).ttl_classes
            except (tomllib.TOMLDecodeError, ValueError) as exc:
                raise UserError(f"cluster file {path} is not valid: {exc}") from None
            want = dict(current)
            if action == "remove":
                if name not in want:
                    raise UserError(f"unknown TTL class {name!r}; classes: {', '.join(want)}")
                del want[name]
            else:
                assert value is not None
                if action == "set" and name not in want:
                    raise UserError(f"unknown TTL class {name!r}; classes: {', '.join(want)} (`ttl add` makes one)")
                if action == "add" and name in want:
                    raise UserError(f"TTL class {name!r} exists already ({_fmt_duration(want[name])}); use `ttl set`")
                want[name] = _duration(value)
            new = edit_ttl_table(text, action, name, value, want)
            try:
                check = cluster_mod.parse(tomllib.loads(new), base_dir=path.parent, path=path).ttl_classes
            except (tomllib.TOMLDecodeError, ValueError) as exc:
                raise UserError(f"editing [ttl] would break {path} ({exc}); it was not changed") from None
            if check != want:
                raise UserError(f"cannot edit the [ttl] table of {path} safely; it was not changed")
            _write_atomic(path, new)
            return want
    except OSError as exc:
        raise UserError(f"cannot rewrite {path}: {exc.strerror or exc}") from None


def cmd_ttl(ctl: Ctl) -> int:
    a = ctl.args
    if a.action == "show":
        return _ttl_show(ctl)
    name = a.cls
    if not _CLASS_NAME.match(name):
        raise UserError(f"bad class name {name!r}: use letters, digits, - and _ (at most 64)")
    value = None
    if a.action in ("set", "add"):
        value = _fmt_duration(_duration(a.duration))
    known = ctl.config.ttl_classes
    if a.action in ("set", "remove") and name not in known:
        raise UserError(f"unknown TTL class {name!r}; classes: {', '.join(known)}")
    if a.action == "add" and name in known:
        raise UserError(f"TTL class {name!r} exists already ({_fmt_duration(known[name])}); use `ttl set`")
    ok, down, failed = ctl.infos()  # the admin check, before the file is touched
    if a.action == "remove":
        if len(known) == 1:
            raise Refused(f"refused: {name!r} is the last TTL class; a cluster needs at least one")
        in_use = {nid: int((i.get("classes") or {}).get(name, 0)) for nid, i in ok.items()}
        total = sum(in_use.values())
        if total:
            holders = ", ".join(str(nid) for nid, n in in_use.items() if n)
            raise Refused(
                f"refused: {total} stored blocks are of class {name!r} (primaries: nodes {holders}); "
                f"evict them (`kvctl evict --class {name}`) or let them expire, then remove it"
            )
        unknown = sorted([*down, *failed])
        if unknown and not a.force:
            raise Refused(
                f"refused: node{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown))} did not answer, so "
                f"blocks of class {name!r} there cannot be counted; bring them up, or pass --force"
            )
    table = _rewrite_ttl(ctl, a.action, name, value)
    pushed = ctl.client.admin("ttl_set", classes=table)
    applied, down2, failed2 = ctl.sort(pushed)
    result = {
        "action": a.action,
        "class": name,
        "seconds": table.get(name),
        "ttl": table,
        "file": str(ctl.path),
        "applied": sorted(applied),
        "down": down2,
        "failed": {str(k): v for k, v in failed2.items()},
    }
    if ctl.json:
        ctl.emit(result)
    else:
        what = {"set": f"{name} = {value}", "add": f"added {name} = {value}", "remove": f"removed {name}"}[a.action]
        ctl.print(
            f"ttl {what}: {ctl.path} rewritten; {len(applied)} of {len(ctl.config.nodes)} nodes use the new table"
        )
        if down2:
            ctl.print(f"[yellow]down:[/] nodes {', '.join(map(str, down2))} (they read the file when they start)")
    if failed2:
        detail = "; ".join(f"node {n}: {why}" for n, why in failed2.items())
        print(
            f"{PROG}: the file changed but some nodes did not take the new table ({detail}); rerun the command",
            file=sys.stderr,
        )
        return 1
    return 0


def _ttl_show(ctl: Ctl) -> int:
    ok, down, failed = ctl.infos()
    file_table = ctl.config.ttl_classes
    counts: dict[str, int] = {}
    for info in ok.values():
        for name, n in (info.get("classes") or {}).items():
            counts[name] = counts.get(name, 0) + int(n)
    differ = {str(nid): i.get("ttl") for nid, i in ok.items() if i.get("ttl") != file_table}
    result = {
        "ttl": file_table,
        "ttl_human": {k: _fmt_duration(v) for k, v in file_table.items()},
        "blocks": {name: counts.get(name, 0) for name in sorted(set(file_table) | set(counts))},
        "nodes_out_of_sync": differ,
        "down": down,
    }
    if ctl.json:
        ctl.emit(result)
        return 0
    table = _table("class", "ttl", "seconds", "blocks", right=("seconds", "blocks"))
    for name in sorted(set(file_table) | set(counts)):
        if name in file_table:
            table.add_row(name, _fmt_duration(file_table[name]), f"{file_table[name]:g}", str(counts.get(name, 0)))
        else:
            table.add_row(f"{name} [red](not in the file)[/]", "-", "-", str(counts[name]))
    ctl.print(table)
    for nid, other in differ.items():
        shown = ", ".join(f"{k} = {_fmt_duration(v)}" for k, v in (other or {}).items())
        ctl.print(f"[yellow]node {nid} uses another table:[/] {shown}")
    ctl.warn_down(down, failed)
    return 0


# --- evict, gc, repair, drain ------------------------------------------------------------------------------------


def _admin_failures(failed: dict[int, str]) -> int:
    if failed:
        detail = "; ".join(f"node {n}: {why}" for n, why in failed.items())
        print(f"{PROG}: not every node did it: {detail}", file=sys.stderr)
        return 1
    return 0


def cmd_evict(ctl: Ctl) -> int:
    a = ctl.args
    if a.cls is None and a.older_than is None:
        raise UserError("evict needs --class CLASS and/or --older-than DURATION")
    older = _duration(a.older_than) if a.older_than is not None else None
    ok, _, _ = ctl.infos()
    if a.cls is not None:
        known = set(ctl.config.ttl_classes)
        for info in ok.values():
            known |= set(info.get("ttl") or {}) | set(info.get("classes") or {})
        if a.cls not in known:
            raise UserError(f"unknown TTL class {a.cls!r}; classes: {', '.join(sorted(known))}")
    meta: dict[str, Any] = {"dry_run": a.dry_run}
    if a.cls is not None:
        meta["ttl_class"] = a.cls
    if older is not None:
        meta["older_than_s"] = older
    done, down, failed = ctl.sort(ctl.client.admin("evict", **meta))
    matched = sum(int(r.get("matched", 0)) for r in done.values())
    evicted = sum(int(r.get("evicted", 0)) for r in done.values())
    result = {
        "dry_run": a.dry_run,
        "ttl_class": a.cls,
        "older_than_s": older,
        "matched": matched,
        "evicted": evicted,
        "nodes": {str(n): {"matched": r.get("matched", 0), "evicted": r.get("evicted", 0)} for n, r in done.items()},
        "down": down,
        "failed": {str(k): v for k, v in failed.items()},
    }
    if ctl.json:
        ctl.emit(result)
    else:
        what = " and ".join(
            x
            for x in (f"class {a.cls}" if a.cls else "", f"created over {_fmt_duration(older)} ago" if older else "")
            if x
        )
        if a.dry_run:
            ctl.print(f"dry run: {matched} blocks of {what} would be evicted (nothing removed)")
        else:
            ctl.print(f"evicted {evicted} of {matched} matching blocks ({what})")
        if down:
            ctl.print(
                f"[yellow]down:[/] nodes {', '.join(map(str, down))}: blocks they are primary for were not looked at"
            )
    return _admin_failures(failed)


_GC_COLUMNS = ("cycles", "evictions", "expirations", "zombies_promoted", "zombies_dropped", "shards_repaired")


def _gc_table(stats: dict[int, dict[str, Any]], extra: dict[int, int] | None = None) -> Any:
    names = ["node", *(c.replace("_", " ") for c in _GC_COLUMNS), "last cycle", "last error"]
    if extra is not None:
        names.insert(1, "repaired now")
    table = _table(*names, right=(*names[1:-1],))
    for nid, s in stats.items():
        row = [str(nid)]
        if extra is not None:
            row.append(str(extra.get(nid, 0)))
        row += [str(s.get(c, 0)) for c in _GC_COLUMNS]
        row += [f"{float(s.get('last_cycle_s', 0)) * 1000:.0f} ms", str(s.get("last_error") or "")]
        table.add_row(*row)
    return table


def cmd_gc(ctl: Ctl) -> int:
    repair = bool(ctl.args.repair)
    done, down, failed = ctl.sort(ctl.client.admin("gc", repair=repair))
    if ctl.json:
        ctl.emit(
            {
                "repair": repair,
                "nodes": {str(n): s for n, s in done.items()},
                "down": down,
                "failed": {str(k): v for k, v in failed.items()},
            }
        )
    else:
        ctl.print(
            f"GC cycle{' with repair' if repair else ''} run on {len(done)} nodes (counts since each node started):"
        )
        ctl.print(_gc_table(done))
        ctl.warn_down(down)
    return _admin_failures(failed)


def _repair(ctl: Ctl, node_ids: list[int] | None) -> tuple[dict[int, dict], list[int], dict[int, str], dict[int, int]]:
    """A GC cycle with repair on ``node_ids``; per node the shards it rewrote during this call.

    Each block's record is held by its primary and by shard 1's node, and both repair it, so when they run at
    the same time one missing shard may be written (and counted) twice.
    """
    before, _, _ = ctl.infos()
    done, down, failed = ctl.sort(ctl.client.admin("gc", node_ids=node_ids, repair=True))
    repaired = {
        nid: int(s.get("shards_repaired", 0)) - int(((before.get(nid) or {}).get("gc") or {}).get("shards_repaired", 0))
        for nid, s in done.items()
    }
    return done, down, failed, repaired


def cmd_repair(ctl: Ctl) -> int:
    done, down, failed, repaired = _repair(ctl, None)
    total = sum(repaired.values())
    if ctl.json:
        ctl.emit(
            {
                "shards_repaired": total,
                "nodes": {str(n): {**s, "repaired_now": repaired[n]} for n, s in done.items()},
                "down": down,
                "failed": {str(k): v for k, v in failed.items()},
            }
        )
    else:
        ctl.print(f"repair: {total} shards rewritten by {len(done)} nodes")
        ctl.print(_gc_table(done, repaired))
        ctl.warn_down(down)
        if down:
            ctl.print("[yellow]blocks with shards on down nodes stay one or two shards short until they are back[/]")
    return _admin_failures(failed)


def cmd_drain(ctl: Ctl) -> int:
    a = ctl.args
    nid = a.node
    if nid not in ctl.config.nodes:
        raise UserError(f"no node {nid} in {ctl.path}; nodes: {min(ctl.config.nodes)}..{max(ctl.config.nodes)}")
    ok, down, failed = ctl.infos()
    if nid not in ok:
        why = "down" if nid in down else failed.get(nid, "no answer")
        if a.undo:
            raise Refused(f"node {nid} is {why}; once restarted it takes new shards anyway")
        raise Refused(
            f"node {nid} is {why}: its shards are already gone; start a node in its place and run `kvctl repair`"
        )
    on = not a.undo
    reply, _, failed_drain = ctl.sort(ctl.client.admin("drain", node_ids=[nid], on=on))
    if nid not in reply:
        raise Refused(f"node {nid} did not take the drain request: {failed_drain.get(nid, 'down')}")
    if a.undo:
        if ctl.json:
            ctl.emit({"node": nid, "draining": False})
        else:
            ctl.print(f"node {nid} takes new shards again")
        return 0
    others = [n for n in sorted(ctl.config.nodes) if n != nid]
    done, rdown, rfailed, repaired = _repair(ctl, others)
    group_mates = sorted({m for g in ctl.config.groups if nid in g for m in g} - {nid})
    blocking = sorted({*(m for m in rdown if m in group_mates), *(m for m in rfailed if m in group_mates)})
    safe = not blocking
    result = {
        "node": nid,
        "draining": True,
        "shards_repaired": sum(repaired.values()),
        "repaired_by": {str(n): r for n, r in repaired.items()},
        "down": rdown,
        "failed": {str(k): v for k, v in rfailed.items()},
        "safe_to_stop": safe,
        "blocking_nodes": blocking,
    }
    if ctl.json:
        ctl.emit(result)
    else:
        ctl.print(f"node {nid} ({ctl.address(nid)}) is draining: it takes no new shards (until restarted or --undo)")
        ctl.print(f"repair on the {len(done)} other nodes that answered: {sum(repaired.values())} shards rewritten")
        if safe:
            ctl.print(
                f"[green]safe to stop node {nid} now:[/] every block has its other 11 shards. Replace it, start the "
                f"new node with the same id and run `kvctl repair` to rewrite its shards."
            )
    if not safe:
        print(
            f"{PROG}: not safe to stop node {nid} yet: node{'s' if len(blocking) > 1 else ''} "
            f"{', '.join(map(str, blocking))} of its placement group did not finish a repair (down or failing); "
            f"bring them back and run `kvctl drain {nid}` again",
            file=sys.stderr,
        )
        return 1
    return 0


# --- top ----------------------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")


def _scrape(host: str, port: int, timeout_s: float = 1.0) -> dict[str, float] | None:
    """Request and byte counters from a node's /metrics endpoint (None when it has none or it fails)."""
    if not port:
        return None
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    out = {"requests": 0.0, "bytes_in": 0.0, "bytes_out": 0.0}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if name == "kvtier_node_requests_total" and 'op="NODE_INFO"' not in (labels or ""):
            out["requests"] += value  # kvctl top's own node-info polls are left out
        elif name == "kvtier_node_bytes_total":
            out["bytes_in" if 'direction="in"' in (labels or "") else "bytes_out"] += value
    return out


class _Top:
    def __init__(self, ctl: Ctl) -> None:
        self.ctl = ctl
        self.previous: dict[int, tuple[float, dict[str, float]]] = {}

    def snapshot(self) -> dict[str, Any]:
        ctl = self.ctl
        try:
            ok, down, failed = ctl.infos()
        except UserError:
            if not self.previous:
                raise
            ok, down, failed = {}, sorted(ctl.config.nodes), {}
        now = time.time()
        nodes = []
        for nid in sorted(ctl.config.nodes):
            row = _node_row(nid, ok.get(nid), ctl, failed.get(nid))
            row.pop("classes", None)
            row.update(ops_total=None, ops_per_s=None, in_bytes_per_s=None, out_bytes_per_s=None)
            if nid in ok:
                node = ctl.config.nodes[nid]
                counters = _scrape(node.host, node.metrics_port)
                if counters is not None:
                    row["ops_total"] = int(counters["requests"])
                    last = self.previous.get(nid)
                    if last is not None and now > last[0]:
                        dt = now - last[0]
                        row["ops_per_s"] = max(0.0, (counters["requests"] - last[1]["requests"]) / dt)
                        row["in_bytes_per_s"] = max(0.0, (counters["bytes_in"] - last[1]["bytes_in"]) / dt)
                        row["out_bytes_per_s"] = max(0.0, (counters["bytes_out"] - last[1]["bytes_out"]) / dt)
                    self.previous[nid] = (now, counters)
            nodes.append(row)
        used = sum(r.get("used_bytes", 0) for r in nodes)
        capacity = sum(r["capacity_bytes"] for r in nodes)
        rates = [r["ops_per_s"] for r in nodes if r["ops_per_s"] is not None]
        return {
            "time": now,
            "nodes": nodes,
            "totals": {
                "up": len(ok),
                "down": len(down),
                "used_bytes": used,
                "capacity_bytes": capacity,
                "used_fraction": _pct(used, capacity),
                "blocks": sum(r.get("blocks", 0) for r in nodes),
                "ops_per_s": sum(rates) if rates else None,
            },
        }

    @staticmethod
    def render(snap: dict[str, Any], interval: float) -> Any:
        from rich.bar import Bar

        t = snap["totals"]
        ops = "-" if t["ops_per_s"] is None else f"{t['ops_per_s']:.0f}"
        title = (
            f"kvtier {datetime.fromtimestamp(snap['time']).strftime('%H:%M:%S')}  {t['up']} up, {t['down']} down  "
            f"used {_size(t['used_bytes'])} of {_size(t['capacity_bytes'])} ({t['used_fraction']:.1%})  "
            f"blocks {t['blocks']}  ops/s {ops}"
        )
        table = _table(
            "node",
            "state",
            "used",
            "",
            "%",
            "blocks",
            "shards",
            "ops/s",
            "in/s",
            "out/s",
            "gc cycles",
            title=title,
            right=("used", "%", "blocks", "shards", "ops/s", "in/s", "out/s", "gc cycles"),
        )
        table.caption = f"every {interval:g} s; Ctrl-C leaves"
        table.caption_justify = "left"
        for r in snap["nodes"]:
            if "used_bytes" not in r:
                table.add_row(str(r["id"]), f"[red]{r['state']}[/]", *["-"] * 9)
                continue
            frac = r["used_fraction"]
            colour = "red" if frac > 0.9 else "yellow" if frac > 0.8 else "green"

            def rate(v: float | None, size: bool = False) -> str:
                if v is None:
                    return "-"
                return f"{_size(v)}" if size else f"{v:.0f}"

            table.add_row(
                str(r["id"]),
                r["state"],
                _size(r["used_bytes"]),
                Bar(1.0, 0.0, min(frac, 1.0), width=20, color=colour),
                f"{frac:.1%}",
                str(r["blocks"]),
                str(r["shards"]),
                rate(r["ops_per_s"]),
                rate(r["in_bytes_per_s"], True),
                rate(r["out_bytes_per_s"], True),
                str((r["gc"] or {}).get("cycles", "-")),
            )
        return table


def cmd_top(ctl: Ctl) -> int:
    a = ctl.args
    if a.interval <= 0 or not math.isfinite(a.interval):
        raise UserError(f"--interval must be a positive number of seconds, got {a.interval}")
    if a.count is not None and a.count <= 0:
        raise UserError(f"--count must be positive, got {a.count}")
    top = _Top(ctl)
    n = 0

    def frames() -> Any:
        nonlocal n
        while a.count is None or n < a.count:
            if n:
                time.sleep(a.interval)
            n += 1
            yield top.snapshot()

    try:
        if ctl.json:
            for snap in frames():
                ctl.emit(snap)
            return 0
        from rich.live import Live

        gen = frames()
        first = next(gen)
        with Live(top.render(first, a.interval), console=ctl.console, auto_refresh=False) as live:
            for snap in gen:
                live.update(top.render(snap, a.interval), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


# --- command line ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``kvctl: error:`` line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    g = common.add_argument_group("global options (also accepted before the command)")
    g.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=f"cluster file (default ${ENV_CONFIG})")
    g.add_argument("--token", default=argparse.SUPPRESS, help="token to use (default: the file's cluster token)")
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    g.add_argument("--timeout", type=float, metavar="S", default=argparse.SUPPRESS, help="per-request timeout")

    parser = _Parser(
        prog=PROG,
        description="Operate a kvtier cluster.",
        epilog=__doc__.split("**Output.**")[0] + __doc__[__doc__.index("Exit status:") :],
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", metavar="PATH", default=None, help=f"the cluster file (default: ${ENV_CONFIG})")
    parser.add_argument("--token", default=None, help="token (default: the cluster file's [cluster] token, the admin)")
    parser.add_argument("--json", action="store_true", default=False, help="print one JSON object instead of tables")
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        default=None,
        help=f"per-request timeout (default: the cluster file's; {LONG_TIMEOUT_S:g} s for gc/repair/drain)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, parents=[common])

    add("status", "cluster summary")
    add("nodes", "per-node usage, state, blocks and GC state")
    p = add("stat", "where a block's shards live, its size, class and times")
    p.add_argument("key", metavar="KEYHEX", help="the block key in hex (32 digits for xxh3_128 keys)")
    p = add("match", "how many leading blocks of a token file are stored")
    p.add_argument("--tokens", required=True, metavar="FILE", help=".npy array, or one integer per line")
    p.add_argument("--model", required=True, help="model id of the namespace")
    p.add_argument("--dtype", required=True, help="KV dtype of the namespace (e.g. bf16)")
    p.add_argument("--block-tokens", required=True, type=int, metavar="N", help="tokens per block")
    p.add_argument("--layout", required=True, help="KV layout of the namespace (e.g. paged)")
    p.add_argument("--salt", default="", help="the namespace's tenant salt (default none)")

    ttl = add("ttl", "show or change TTL classes")
    tsub = ttl.add_subparsers(dest="action", required=True, metavar="ACTION")
    tsub.add_parser("show", help="the TTL table and blocks per class", parents=[common])
    for action, help_text in (("set", "change a class's TTL"), ("add", "add a class")):
        q = tsub.add_parser(action, help=help_text, parents=[common])
        q.add_argument("cls", metavar="CLASS")
        q.add_argument("duration", metavar="DURATION", help="e.g. 30s, 12h, 3d")
    q = tsub.add_parser("remove", help="remove a class no stored block uses", parents=[common])
    q.add_argument("cls", metavar="CLASS")
    q.add_argument("--force", action="store_true", help="remove even while some nodes are down")

    p = add("evict", "remove blocks by class and/or age")
    p.add_argument("--class", dest="cls", metavar="CLASS", help="blocks of this TTL class")
    p.add_argument("--older-than", metavar="DURATION", help="blocks created longer ago than this (e.g. 12h)")
    p.add_argument("--dry-run", action="store_true", help="count what would go, remove nothing")
    gc = add("gc", "run GC now")
    gsub = gc.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = gsub.add_parser("run", help="one GC cycle on every node", parents=[common])
    q.add_argument("--repair", action="store_true", help="with a repair pass")
    add("repair", "restore every block's 12 shards")
    p = add("drain", "take a node out of service so it can be replaced")
    p.add_argument("node", type=int, metavar="NODE", help="node id")
    p.add_argument("--undo", action="store_true", help="let the node take shards again")
    p = add("top", "live view of node usage and request rates")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (default 1)")
    p.add_argument("--count", type=int, default=None, metavar="N", help="stop after N refreshes")
    return parser


COMMANDS: dict[str, Callable[[Ctl], int]] = {
    "status": cmd_status,
    "nodes": cmd_nodes,
    "stat": cmd_stat,
    "match": cmd_match,
    "ttl": cmd_ttl,
    "evict": cmd_evict,
    "gc": cmd_gc,
    "repair": cmd_repair,
    "drain": cmd_drain,
    "top": cmd_top,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvtier.kvstore.transport import AuthError

    ctl: Ctl | None = None
    try:
        ctl = Ctl(args)
        return COMMANDS[args.command](ctl)
    except UserError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except Refused as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except AuthError as exc:
        whose = "--token" if args.token else f"the token in {args.config or os.environ.get(ENV_CONFIG)}"
        print(
            f"{PROG}: the nodes rejected {whose} ({exc}): use the cluster file's [cluster] token or a tenant's token",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep Python's exit-time flush quiet
        return 1
    finally:
        if ctl is not None:
            ctl.close()


if __name__ == "__main__":
    sys.exit(main())
