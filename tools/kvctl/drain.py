"""``kvctl drain NODE [--undo]``: take a node out of service so that it can be replaced."""

from __future__ import annotations

import sys

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import PROG, Ctl, Refused, UserError
from kvtier.tools.kvctl.gc import repair_nodes


def cmd_drain(ctl: Ctl) -> int:
    a = ctl.args
    nid = a.node
    if nid not in ctl.config.nodes:
        raise UserError(f"no node {nid} in {ctl.path}; nodes: {min(ctl.config.nodes)}..{max(ctl.config.nodes)}")
    ok, down, failed = ctl.infos()
    if nid not in ok:
        why = "down" if nid in down else failed.get(nid, "no answer")
        if a.undo:
            raise Refused(
                f"node {nid} is {why}; it keeps its drain flag: start it, then run `kvctl drain {nid} --undo`"
            )
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
    done, rdown, rfailed, repaired = repair_nodes(ctl, others)
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
        ctl.print(
            f"node {nid} ({ctl.address(nid)}) is draining: it takes no new shards (until --undo, restarts included)"
        )
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


def register(commands: Subcommands) -> None:
    p = commands.add("drain", "take a node out of service so it can be replaced", cmd_drain, long_running=True)
    p.add_argument("node", type=int, metavar="NODE", help="node id")
    p.add_argument("--undo", action="store_true", help="let the node take shards again")
