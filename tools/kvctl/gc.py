"""``kvctl evict``, ``kvctl gc run``, ``kvctl repair`` and ``kvctl scrub``: removing blocks, running the nodes'
GC now, restoring redundancy and checking every shard's bytes."""

from __future__ import annotations

from typing import Any

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import (
    Ctl,
    UserError,
    fmt_duration,
    fmt_size,
    new_table,
    report_failures,
    user_duration,
)


def cmd_evict(ctl: Ctl) -> int:
    a = ctl.args
    if a.cls is None and a.older_than is None:
        raise UserError("evict needs --class CLASS and/or --older-than DURATION")
    older = user_duration(a.older_than) if a.older_than is not None else None
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
            for x in (f"class {a.cls}" if a.cls else "", f"created over {fmt_duration(older)} ago" if older else "")
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
    return report_failures(failed)


_GC_COLUMNS = ("cycles", "evictions", "expirations", "zombies_promoted", "zombies_dropped", "shards_repaired")


def _gc_table(stats: dict[int, dict[str, Any]], extra: dict[int, int] | None = None) -> Any:
    names = ["node", *(c.replace("_", " ") for c in _GC_COLUMNS), "last cycle", "last error"]
    if extra is not None:
        names.insert(1, "repaired now")
    table = new_table(*names, right=(*names[1:-1],))
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
    return report_failures(failed)


def repair_nodes(
    ctl: Ctl, node_ids: list[int] | None, rebuild: bool = False
) -> tuple[dict[int, dict], list[int], dict[int, str], dict[int, int]]:
    """A GC cycle with repair on ``node_ids``; per node the shards it rewrote during this call.

    A block is repaired by the first of the holders of shards 0, 1, 2 that keeps its record (and, after a
    wipe, by the first holder that lost a shard), so a shard is normally written once; counts include what the
    nodes' background repair rewrote meanwhile.
    """
    before, _, _ = ctl.infos()
    done, down, failed = ctl.sort(ctl.client.admin("gc", node_ids=node_ids, repair=True, rebuild=rebuild))
    repaired = {
        nid: int(s.get("shards_repaired", 0)) - int(((before.get(nid) or {}).get("gc") or {}).get("shards_repaired", 0))
        for nid, s in done.items()
    }
    return done, down, failed, repaired


def cmd_repair(ctl: Ctl) -> int:
    done, down, failed, repaired = repair_nodes(ctl, None, rebuild=ctl.args.rebuild)
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
    return report_failures(failed)


_SCRUB_COLUMNS = ("shards_checked", "bytes_checked", "corrupt", "repaired", "owed")


def cmd_scrub(ctl: Ctl) -> int:
    done, down, failed = ctl.sort(ctl.client.admin("scrub"))
    totals = {c: sum(int(r.get(c, 0)) for r in done.values()) for c in _SCRUB_COLUMNS}
    if ctl.json:
        ctl.emit(
            {
                **totals,
                "nodes": {str(n): {c: r.get(c, 0) for c in _SCRUB_COLUMNS} for n, r in done.items()},
                "down": down,
                "failed": {str(k): v for k, v in failed.items()},
            }
        )
    else:
        ctl.print(
            f"scrub: {totals['shards_checked']} shards ({fmt_size(totals['bytes_checked'])}) checked on "
            f"{len(done)} nodes; {totals['corrupt']} corrupt, {totals['repaired']} rewritten"
        )
        names = ["node", "shards checked", "bytes", "corrupt", "repaired", "repairs owed"]
        table = new_table(*names, right=names[1:])
        for nid, r in done.items():
            counts = [str(r.get(c, 0)) for c in _SCRUB_COLUMNS]
            counts[1] = fmt_size(int(r.get("bytes_checked", 0)))
            table.add_row(str(nid), *counts)
        ctl.print(table)
        ctl.warn_down(down)
        if totals["corrupt"] > totals["repaired"]:
            ctl.print("[yellow]corrupt shards not rewritten yet are owed: the nodes' repair retries them[/]")
    return report_failures(failed)


def register(commands: Subcommands) -> None:
    p = commands.add("evict", "remove blocks by class and/or age", cmd_evict)
    p.add_argument("--class", dest="cls", metavar="CLASS", help="blocks of this TTL class")
    p.add_argument("--older-than", metavar="DURATION", help="blocks created longer ago than this (e.g. 12h)")
    p.add_argument("--dry-run", action="store_true", help="count what would go, remove nothing")
    gc = commands.group("gc", "run GC now")
    q = gc.add("run", "one GC cycle on every node", cmd_gc, long_running=True)
    q.add_argument("--repair", action="store_true", help="with a repair pass")
    r = commands.add("repair", "restore every block's 12 shards", cmd_repair, long_running=True)
    r.add_argument(
        "--rebuild",
        action="store_true",
        help="also rebuild from every node's shards the blocks no record names any more (scans every node)",
    )
    commands.add("scrub", "check every shard's crc32c now and rewrite the corrupt ones", cmd_scrub, long_running=True)
