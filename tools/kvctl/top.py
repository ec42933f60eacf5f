"""``kvctl top``: live node usage and request rates (node info plus each node's Prometheus ``/metrics``)."""

from __future__ import annotations

import math
import time
import urllib.request
from datetime import datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvtier.kvstore.cluster.config import LOCAL_HOSTS, NodeConfig
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import Ctl, UserError, fmt_size, fraction, new_table, node_row


def _metrics_host(node: NodeConfig) -> str | None:
    """Where a node's /metrics can be reached from here: its ``metrics_host``, or its data address when that is
    every interface; None when it listens on loopback on another machine (only that machine can scrape it)."""
    if node.metrics_host in ("0.0.0.0", "::", ""):
        return node.host
    loopback = node.metrics_host in LOCAL_HOSTS or node.metrics_host.startswith("127.")
    if loopback and node.host not in LOCAL_HOSTS:
        return None
    return node.metrics_host


def _scrape(host: str | None, port: int, timeout_s: float = 1.0) -> dict[str, float] | None:
    """Request and byte counters from a node's /metrics endpoint (None when it has none, or it fails or does not
    parse)."""
    if not port or host is None:
        return None
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except (OSError, ValueError):
        return None
    out = {"requests": 0.0, "bytes_in": 0.0, "bytes_out": 0.0}
    for sample in samples:
        if sample.name == "kvtier_node_requests_total" and sample.labels.get("op") != "NODE_INFO":
            out["requests"] += sample.value  # kvctl top's own node-info polls are left out
        elif sample.name == "kvtier_node_bytes_total":
            out["bytes_in" if sample.labels.get("direction") == "in" else "bytes_out"] += sample.value
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
            row = node_row(nid, ok.get(nid), ctl, failed.get(nid))
            row.pop("classes", None)
            row.update(ops_total=None, ops_per_s=None, in_bytes_per_s=None, out_bytes_per_s=None)
            if nid in ok:
                node = ctl.config.nodes[nid]
                counters = _scrape(_metrics_host(node), node.metrics_port)
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
                "used_fraction": fraction(used, capacity),
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
            f"used {fmt_size(t['used_bytes'])} of {fmt_size(t['capacity_bytes'])} ({t['used_fraction']:.1%})  "
            f"blocks {t['blocks']}  ops/s {ops}"
        )
        table = new_table(
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
                return f"{fmt_size(v)}" if size else f"{v:.0f}"

            table.add_row(
                str(r["id"]),
                r["state"],
                fmt_size(r["used_bytes"]),
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


def register(commands: Subcommands) -> None:
    p = commands.add("top", "live view of node usage and request rates", cmd_top)
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (default 1)")
    p.add_argument("--count", type=int, default=None, metavar="N", help="stop after N refreshes")
