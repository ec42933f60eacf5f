"""What every kvctl command shares: the invocation (:class:`Ctl`: options, cluster file, client, output), the
two user-facing errors and formatting helpers.

A command module ``tools/kvctl/NAME.py`` has ``register(commands: Subcommands) -> None`` (``tools.cliutil``),
which adds its subcommand(s) with ``commands.add(name, help, run)``; ``run(ctl)`` returns the exit status and
raises :class:`UserError` (status 2) or :class:`Refused` (status 1) with one line. A command that waits for GC
cycles registers with ``long_running=True``: its requests wait :data:`LONG_TIMEOUT_S` unless ``--timeout`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

PROG = "kvctl"
ENV_CONFIG = "KVTIER_CONFIG"
LONG_TIMEOUT_S = 600.0  # gc/repair/drain: a node answers when its cycle (rate-limited repair) is done

# --- errors ---------------------------------------------------------------------------------------------------


class UserError(Exception):
    """Something the user can fix (exit status 2)."""


class Refused(Exception):
    """The cluster refused, or the command could not complete (exit status 1)."""


# --- small helpers --------------------------------------------------------------------------------------------


def fmt_span(seconds: float) -> str:
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


def fmt_when(ts: float | None, now: float | None = None) -> str:
    """An absolute local time and how far from now it is: ``2025-06-01 12:00:03 (5m ago)``."""
    if ts is None:
        return "-"
    now = time.time() if now is None else now
    stamp = datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    delta = ts - now
    return f"{stamp} ({'in ' + fmt_span(delta) if delta > 0 else fmt_span(delta) + ' ago'})"


def fraction(used: float, capacity: float) -> float:
    return used / capacity if capacity else 0.0


def fmt_size(n: float) -> str:
    from kvtier.kvstore.units import format_size

    return format_size(n)


def user_duration(text: str) -> float:
    from kvtier.kvstore.units import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def fmt_duration(seconds: float) -> str:
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
        if args.token is not None:
            raise UserError(
                "--token puts the token where every user's `ps` can read it: give it with --token-file PATH (mode "
                "0600) or $KVTIER_TOKEN"
            )
        self.config = self._load(self.path, args.token_file)
        self._client: Any = None
        self._console: Any = None
        self.command = args.command + (f" {args.action}" if getattr(args, "action", None) else "")

    @staticmethod
    def _load(path: Path, token_file: str | None) -> Any:
        """The cluster file with the token to present: ``--token-file``, ``$KVTIER_TOKEN``, else the file's own (the
        admin)."""
        from kvtier.kvstore.cluster import config as cluster_mod
        from kvtier.kvstore.cluster import map as cluster_map

        try:
            token = cluster_mod.read_token_file(token_file) if token_file is not None else None
            return cluster_map.load_client(path, token)
        except cluster_mod.ConfigError as exc:
            raise UserError(f"{exc}") from None

    @property
    def client(self) -> Any:
        if self._client is None:
            from kvtier.kvstore.client import Client

            config = self.config
            timeout = self.args.timeout
            if timeout is None and self.args.long_running:
                timeout = LONG_TIMEOUT_S
            if timeout is not None:
                config = dataclasses.replace(config, client=dataclasses.replace(config.client, op_timeout_s=timeout))
            self._client = Client(config)
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
        if self.config.feed is not None:
            self.config.feed.close()

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
            f"leave out --token-file and $KVTIER_TOKEN to use the cluster file's [cluster] token"
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


def new_table(*columns: str, title: str | None = None, right: Sequence[str] = ()) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    return table


def primary_blocks(info: dict[str, Any]) -> int:
    return sum(int(v) for v in (info.get("classes") or {}).values())


def node_state(info: dict[str, Any] | None) -> str:
    if info is None:
        return "down"
    return "draining" if info.get("draining") else "up"


def node_row(nid: int, info: dict[str, Any] | None, ctl: Ctl, error: str | None = None) -> dict[str, Any]:
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
            "state": node_state(info),
            "used_bytes": int(info["used_bytes"]),
            "freeing_bytes": int(info.get("freeing_bytes", 0)),
            "capacity_bytes": int(info["capacity_bytes"]),
            "used_fraction": fraction(info["used_bytes"], info["capacity_bytes"]),
            "shards": int(info.get("shards", 0)),
            "blocks": primary_blocks(info),
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


def report_failures(failed: dict[int, str]) -> int:
    if failed:
        detail = "; ".join(f"node {n}: {why}" for n, why in failed.items())
        print(f"{PROG}: not every node did it: {detail}", file=sys.stderr)
        return 1
    return 0
