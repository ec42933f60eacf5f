"""``kvctl ttl show|set|add|remove``: the TTL table, in the cluster file and on the nodes."""

from __future__ import annotations

import re
import sys
from typing import Any

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import PROG, Ctl, Refused, UserError, fmt_duration, new_table, user_duration

_CLASS_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _rewrite_map_ttl(ctl: Ctl, action: str, name: str, value: str | None) -> tuple[dict[str, float], int]:
    """Change one class in the etcd map's TTL table (one map transaction); the new table and map revision. Nodes
    follow the map themselves."""
    from kvtier.tools.kvctl.topology import edit_map

    def edit(doc: dict[str, Any]) -> bool:
        table = doc["ttl"]
        if action == "remove":
            table.pop(name, None)
        else:
            table[name] = user_duration(value)  # type: ignore[arg-type]
        return True

    revision = edit_map(ctl, edit)
    doc, _ = ctl.config.feed.store.read()
    return {k: float(v) for k, v in doc["ttl"].items()}, revision


def _rewrite_ttl(ctl: Ctl, action: str, name: str, value: str | None) -> dict[str, float]:
    """Change one class in the cluster file's ``[ttl]`` table (``cluster.config.edit``: comments, layout and order kept,
    replaced atomically under a lock); the whole new table. A file without a ``[ttl]`` table (the default classes)
    gets one, listing them all."""
    from kvtier.kvstore.cluster import config as cluster_mod

    try:
        with cluster_mod.edit(ctl.path) as doc:
            current = cluster_mod.parse(doc.unwrap(), base_dir=ctl.path.parent).ttl_classes
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
                    raise UserError(f"TTL class {name!r} exists already ({fmt_duration(want[name])}); use `ttl set`")
                want[name] = user_duration(value)
            if "ttl" not in doc:
                doc["ttl"] = {k: fmt_duration(v) for k, v in want.items()}
            elif action == "remove":
                del doc["ttl"][name]
            else:
                doc["ttl"][name] = value
            if cluster_mod.parse(doc.unwrap(), base_dir=ctl.path.parent).ttl_classes != want:
                raise UserError(f"cannot edit the [ttl] table of {ctl.path} safely; it was not changed")
    except ValueError as exc:  # ConfigError, or a value parse() could not convert
        raise UserError(str(exc)) from None
    return want


def cmd_ttl(ctl: Ctl) -> int:
    a = ctl.args
    if a.action == "show":
        return _ttl_show(ctl)
    name = a.cls
    if not _CLASS_NAME.match(name):
        raise UserError(f"bad class name {name!r}: use letters, digits, - and _ (at most 64)")
    value = None
    if a.action in ("set", "add"):
        value = fmt_duration(user_duration(a.duration))
    known = ctl.config.ttl_classes
    if a.action in ("set", "remove") and name not in known:
        raise UserError(f"unknown TTL class {name!r}; classes: {', '.join(known)}")
    if a.action == "add" and name in known:
        raise UserError(f"TTL class {name!r} exists already ({fmt_duration(known[name])}); use `ttl set`")
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
    revision = 0
    if ctl.config.feed is not None:
        table, revision = _rewrite_map_ttl(ctl, a.action, name, value)
    else:
        table = _rewrite_ttl(ctl, a.action, name, value)
    pushed = ctl.client.admin("ttl_set", classes=table)
    applied, down2, failed2 = ctl.sort(pushed)
    result = {
        "action": a.action,
        "class": name,
        "seconds": table.get(name),
        "ttl": table,
        "file": str(ctl.path),
        "revision": revision,  # the etcd map's, after the change (0: a cluster file)
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
        "ttl_human": {k: fmt_duration(v) for k, v in file_table.items()},
        "blocks": {name: counts.get(name, 0) for name in sorted(set(file_table) | set(counts))},
        "nodes_out_of_sync": differ,
        "down": down,
    }
    if ctl.json:
        ctl.emit(result)
        return 0
    table = new_table("class", "ttl", "seconds", "blocks", right=("seconds", "blocks"))
    for name in sorted(set(file_table) | set(counts)):
        if name in file_table:
            table.add_row(name, fmt_duration(file_table[name]), f"{file_table[name]:g}", str(counts.get(name, 0)))
        else:
            table.add_row(f"{name} [red](not in the file)[/]", "-", "-", str(counts[name]))
    ctl.print(table)
    for nid, other in differ.items():
        shown = ", ".join(f"{k} = {fmt_duration(v)}" for k, v in (other or {}).items())
        ctl.print(f"[yellow]node {nid} uses another table:[/] {shown}")
    ctl.warn_down(down, failed)
    return 0


def register(commands: Subcommands) -> None:
    ttl = commands.group("ttl", "show or change TTL classes")
    ttl.add("show", "the TTL table and blocks per class", _ttl_show)
    for action, help_text in (("set", "change a class's TTL"), ("add", "add a class")):
        q = ttl.add(action, help_text, cmd_ttl)
        q.add_argument("cls", metavar="CLASS")
        q.add_argument("duration", metavar="DURATION", help="e.g. 30s, 12h, 3d")
    q = ttl.add("remove", "remove a class no stored block uses", cmd_ttl)
    q.add_argument("cls", metavar="CLASS")
    q.add_argument("--force", action="store_true", help="remove even while some nodes are down")
