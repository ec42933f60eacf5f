"""``kvctl map``, ``host add``, ``node replace``, ``group add``: the cluster map in etcd, and changing it.

Every change is one map transaction (compare-and-swap on the map's revision, ``MapStore.update``): two operators
never lose each other's change, and an edit is checked as a whole before it is written (a group that would put
more than ``max_slots_per_host`` of its slots on one host is refused, one line, nothing written). Nodes and
clients follow the map within a second or two; ``kvstore serve`` on a host starts the nodes the map moves there.
"""

from __future__ import annotations

import secrets
from typing import Any

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import Ctl, Refused, UserError, fmt_size


def edit_map(ctl: Ctl, edit: Any) -> int:
    """Apply ``edit`` (``MapStore.update``) to the map the cluster file names; the map's new revision.

    UserError for a cluster file that names no etcd map or an edit the map's checks refuse; Refused when etcd
    cannot be reached."""
    from kvtier.kvstore.cluster.config import ConfigError
    from kvtier.kvstore.cluster.etcd import EtcdUnavailable

    feed = ctl.config.feed
    if feed is None:
        raise UserError(f"{ctl.path} is a self-contained cluster file, not an etcd map: edit the file instead")
    try:
        return int(feed.store.update(edit))
    except ConfigError as exc:
        raise UserError(f"refused: {exc}") from None
    except EtcdUnavailable as exc:
        raise Refused(f"the map was not changed: {exc}") from None


def _doc(ctl: Ctl) -> dict[str, Any]:
    feed = ctl.config.feed
    if feed is None:
        raise UserError(f"{ctl.path} is a self-contained cluster file, not an etcd map")
    return feed.doc  # type: ignore[no-any-return]


def cmd_map(ctl: Ctl) -> int:
    from kvtier.gc.fill import read_progress

    doc = _doc(ctl)
    progress = read_progress(ctl.config.feed)
    result = {
        "revision": ctl.config.revision,
        "hosts": doc["hosts"],
        "nodes": doc["nodes"],
        "groups": doc["groups"],
        "previous_groups": doc.get("previous_groups", []),
        "max_slots_per_host": doc.get("max_slots_per_host"),
        "members": sorted(ctl.config.feed.members),
        "repair_progress": {str(k): v for k, v in progress.items()},
    }
    if ctl.json:
        ctl.emit(result)
        return 0
    from kvtier.tools.kvctl.ctl import new_table

    ctl.print(f"cluster map {doc['name']!r}, revision {ctl.config.revision}: {len(doc['hosts'])} hosts")
    table = new_table("node", "host", "address", "state", "filling", "capacity", "repair pass", right=("node",))
    for node in doc["nodes"]:
        p = progress.get(node["id"], {})
        repair = f"{p.get('checked', 0)}/{max(0, p.get('total', 0))}{' done' if p.get('done') else ''}" if p else "-"
        table.add_row(
            str(node["id"]),
            node["host"],
            f"{doc['hosts'][node['host']]}:{node['port']}",
            node["state"],
            "yes" if node["filling"] else "",
            fmt_size(node["capacity"]),
            repair,
        )
    ctl.print(table)
    for g, group in enumerate(doc["groups"]):
        ctl.print(f"group {g}: nodes {', '.join(map(str, group))}")
    return 0


def cmd_host_add(ctl: Ctl) -> int:
    name, address = ctl.args.name, ctl.args.address

    def add(doc: dict[str, Any]) -> bool:
        if doc["hosts"].get(name) == address:
            return False
        if name in doc["hosts"]:
            raise UserError(f"host {name!r} exists already, at {doc['hosts'][name]}")
        doc["hosts"][name] = address
        return True

    revision = edit_map(ctl, add)
    if ctl.json:
        ctl.emit({"host": name, "address": address, "revision": revision})
    else:
        ctl.print(f"host {name} ({address}) added (map revision {revision}); run `kvstore serve` there")
    return 0


def cmd_node_replace(ctl: Ctl) -> int:
    a = ctl.args
    nid, host = a.node, a.host
    token = secrets.token_hex(8)

    def replace(doc: dict[str, Any]) -> bool:
        from kvtier.kvstore.cluster.map import node_entry

        node = node_entry(doc, nid)
        if host not in doc["hosts"]:
            raise UserError(f"unknown host {host!r} (hosts: {', '.join(doc['hosts'])}); add it: `kvctl host add`")
        data_dir = a.data_dir or node["data_dir"]
        port = a.port or node["port"]
        if node["host"] == host and node["data_dir"] == data_dir and node["port"] == port and node["filling"]:
            return False  # done already (a retried transaction)
        node.update(host=host, port=port, data_dir=data_dir, state="new", filling=token)
        return True

    revision = edit_map(ctl, replace)
    result = {"node": nid, "host": host, "revision": revision, "filling": token}
    if ctl.json:
        ctl.emit(result)
    else:
        ctl.print(
            f"node {nid} now lives on {host} (map revision {revision}); `kvstore serve` there starts it empty, and "
            f"repair fills it (reads go around it meanwhile): follow with `kvctl map`"
        )
    return 0


def cmd_group_add(ctl: Ctl) -> int:
    from kvtier.kvstore.cluster.map import _node_entry, spread_groups
    from kvtier.kvstore.codec import TOTAL_SHARDS
    from kvtier.kvstore.units import parse_size

    a = ctl.args
    hosts = [h for h in a.hosts.split(",") if h]
    if len(hosts) * a.nodes_per_host != TOTAL_SHARDS:
        raise UserError(f"a group is {TOTAL_SHARDS} nodes: {len(hosts)} hosts × {a.nodes_per_host} is not")
    added: list[int] = []

    token = secrets.token_hex(8)

    def grow(doc: dict[str, Any]) -> bool:
        if doc.get("growth") == token:
            return False  # done already (a retried transaction)
        if doc.get("growth"):
            raise Refused("refused: the last growth is still moving blocks (`kvctl map` shows it); add a group after")
        unknown = [h for h in hosts if h not in doc["hosts"]]
        if unknown:
            raise UserError(f"unknown hosts {unknown}: add them first (`kvctl host add NAME ADDRESS`)")
        first = max(n["id"] for n in doc["nodes"]) + 1
        template = doc["nodes"][0]
        root = template["data_dir"].rsplit("/", 1)[0]
        capacity = parse_size(a.capacity) if a.capacity else template["capacity"]
        new = []
        for h, host in enumerate(hosts):
            taken = {n["port"] for n in doc["nodes"] if n["host"] == host}
            port = max(taken) + 1 if taken else a.base_port
            for k in range(a.nodes_per_host):
                nid = first + h * a.nodes_per_host + k
                new.append(_node_entry(nid, host, port + k, f"{root}/node-{nid}", capacity))
        doc["nodes"].extend(new)
        doc["previous_groups"] = [list(g) for g in doc["groups"]]
        doc["groups"].extend(spread_groups(doc, [n["id"] for n in new]))
        doc["growth"] = token
        added[:] = [n["id"] for n in new]
        return True

    revision = edit_map(ctl, grow)
    if ctl.json:
        ctl.emit({"nodes": added, "revision": revision})
    else:
        ctl.print(
            f"group of nodes {', '.join(map(str, added))} added (map revision {revision}); the blocks it takes move "
            f"there as the old groups' nodes repair: follow with `kvctl map`"
        )
    return 0


def register(commands: Subcommands) -> None:
    commands.add("map", "the cluster map in etcd: hosts, nodes and their states, groups, repair progress", cmd_map)
    host = commands.group("host", "hosts of the etcd map")
    q = host.add("add", "add a host (a failure domain) that nodes may live on", cmd_host_add)
    q.add_argument("name")
    q.add_argument("address", help="the address its nodes bind and clients reach")
    node = commands.group("node", "nodes of the etcd map")
    q = node.add("replace", "move a node to another host, empty: repair fills it", cmd_node_replace)
    q.add_argument("node", type=int)
    q.add_argument("--host", required=True, help="the host it moves to")
    q.add_argument("--port", type=int, default=None, help="its port there (default: the same)")
    q.add_argument("--data-dir", default=None, help="its data dir there (default: the same path)")
    group = commands.group("group", "placement groups of the etcd map")
    q = group.add("add", "add 12 new nodes as a placement group (blocks move there by repair)", cmd_group_add)
    q.add_argument("--hosts", required=True, help="hosts of the new nodes, comma-separated")
    q.add_argument("--nodes-per-host", type=int, default=2)
    q.add_argument("--capacity", default=None, help="per node (default: as the first node's)")
    q.add_argument("--base-port", type=int, default=7400)
