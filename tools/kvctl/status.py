"""``kvctl status`` (the cluster in one table) and ``kvctl nodes`` (one row per node)."""

from __future__ import annotations

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import Ctl, fmt_duration, fmt_size, fraction, new_table, node_row


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
        "used_fraction": fraction(used, capacity),
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
    table = new_table("", "", title=f"cluster {cfg.name} ({ctl.path})")
    table.show_header = False
    nodes_line = f"{len(ok)} up, {len(down)} down of {len(cfg.nodes)} ({len(cfg.groups)} placement group"
    nodes_line += "s)" if len(cfg.groups) > 1 else ")"
    if draining:
        nodes_line += f"; draining: {', '.join(map(str, draining))}"
    if down:
        nodes_line += f"; down: {', '.join(map(str, down))}"
    table.add_row("nodes", nodes_line)
    table.add_row("capacity", fmt_size(capacity))
    freeing_note = f", {fmt_size(freeing)} freeing" if freeing else ""
    table.add_row("used", f"{fmt_size(used)} ({fraction(used, capacity):.1%}){freeing_note}")
    table.add_row("watermarks", f"high {high:.0%}, low {low:.0%}")
    classes = ", ".join(f"{name} {count}" for name, count in sorted(by_class.items()))
    table.add_row("blocks", f"{sum(by_class.values())}" + (f" ({classes})" if classes else ""))
    table.add_row("codec", backend)
    ttl = ", ".join(f"{name} = {fmt_duration(s)}" for name, s in cfg.ttl_classes.items())
    table.add_row("ttl classes", ttl)
    if out_of_sync:
        table.add_row("", f"[yellow]nodes with another TTL table: {', '.join(map(str, out_of_sync))}[/]")
    ctl.print(table)
    ctl.warn_down([], failed)
    return 0


def cmd_nodes(ctl: Ctl) -> int:
    ok, _, failed = ctl.infos()
    rows = [node_row(nid, ok.get(nid), ctl, failed.get(nid)) for nid in sorted(ctl.config.nodes)]
    if ctl.json:
        ctl.emit({"nodes": rows})
        return 0
    table = new_table(
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
                fmt_size(row["capacity_bytes"]),
                *["-"] * 6,
                row.get("error", ""),
            )
            continue
        gc = row["gc"] or {}
        table.add_row(
            str(row["id"]),
            row["address"],
            state,
            fmt_size(row["used_bytes"]),
            fmt_size(row["capacity_bytes"]),
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


def register(commands: Subcommands) -> None:
    commands.add("status", "cluster summary", cmd_status)
    commands.add("nodes", "per-node usage, state, blocks and GC state", cmd_nodes)
