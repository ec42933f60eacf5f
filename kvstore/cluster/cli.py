"""``kvstore``: create a cluster (``init``), run its nodes on this host (``serve``), and reset a node whose data is
lost or corrupt (``reset-node``: its data moved aside, it rejoins empty and is refilled by repair)."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

import tomlkit

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.cluster.etcd import Etcd, EtcdUnavailable
from kvtier.kvstore.cluster.local import reset_node, serve
from kvtier.kvstore.codec import PARITY_SHARDS
from kvtier.kvstore.units import parse_size


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore", description="kvtier block store: set up and run nodes.")
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser(
        "init", help="write DIR/cluster.toml for a local cluster, or (--etcd) a cluster map in etcd and its file"
    )
    init.add_argument("dir")
    init.add_argument("--nodes", type=int, default=12, help="number of nodes, a multiple of 12 (default 12)")
    init.add_argument("--capacity", default="2GiB", help="capacity per node, e.g. 2GiB (default)")
    init.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="first port (default: free ports below the ephemeral range, or in $KVTIER_PORT_RANGE; 7400 with --etcd)",
    )
    etcd = init.add_argument_group("a cluster on many hosts, its map in etcd")
    etcd.add_argument("--etcd", metavar="URL[,URL...]", help="etcd endpoints: write the map there")
    etcd.add_argument("--name", default="kvtier", help="the cluster's name (its etcd prefix /kvtier/NAME/)")
    etcd.add_argument("--hosts", metavar="NAME=ADDR,...", help="the hosts (failure domains) and their addresses")
    etcd.add_argument("--nodes-per-host", type=int, default=2, help="nodes on each host (default 2)")
    etcd.add_argument("--data-root", default="/srv/kvtier", help="nodes keep data in DATA_ROOT/node-ID on their host")
    etcd.add_argument(
        "--max-slots-per-host",
        type=int,
        default=PARITY_SHARDS,
        help=f"most slots of one placement group on one host (default {PARITY_SHARDS}: a host's loss loses no block)",
    )
    etcd.add_argument("--lease-ttl", type=float, default=cluster_map.DEFAULT_LEASE_TTL_S, help="membership lease, s")
    run = sub.add_parser("serve", help="start this host's nodes (a cluster file's local ones, or the map's)")
    run.add_argument("config")
    run.add_argument("--host-id", default=None, help="this host's name in the etcd map (an etcd cluster file)")
    run.add_argument("--etcd", default=None, metavar="URL[,URL...]", help="etcd endpoints instead of the file's")
    reset = sub.add_parser(
        "reset-node",
        help="move a stopped node's data dir aside (timestamped) and give it an empty one; started again, it "
        "rebuilds what it should hold from its peers",
    )
    reset.add_argument("config")
    reset.add_argument("node_id", type=int)
    args = parser.parse_args(argv)
    try:
        if args.command == "init" and args.etcd:
            return _init_etcd(args)
        if args.command == "init":
            path = cluster_mod.write_default(
                args.dir, nodes=args.nodes, capacity_bytes=parse_size(args.capacity), base_port=args.base_port
            )
            public = cluster_mod.public_path(path)
            print(
                f"wrote {path} ({args.nodes} nodes, {args.capacity} each; mode 0600: it holds every token) "
                f"and {public} (no tokens, for clients); start the nodes with `kvstore serve {path}`"
            )
            return 0
        if args.command == "reset-node":
            aside = reset_node(args.config, args.node_id)
            print(
                f"node {args.node_id}'s data moved to {aside}; start the node again: it rejoins empty and rebuilds "
                "what it should hold from its peers (`kvctl repair` does it at once)"
            )
            return 0
        return serve(args.config, host_id=args.host_id, etcd=args.etcd)
    except (cluster_mod.ConfigError, ValueError, EtcdUnavailable) as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2


def _init_etcd(args: argparse.Namespace) -> int:
    """Write the cluster map into etcd (never over an existing one) and DIR/cluster.toml (mode 0600: it holds the
    admin token) naming it; copy that file to every host and client."""
    if not args.hosts:
        raise cluster_mod.ConfigError("--etcd needs --hosts NAME=ADDR,... (the hosts the nodes run on)")
    hosts: dict[str, str] = {}
    for item in args.hosts.split(","):
        name, sep, address = item.strip().partition("=")
        if not sep or not name or not address or name in hosts:
            raise cluster_mod.ConfigError(f"--hosts: {item!r} is not NAME=ADDRESS (each name once)")
        hosts[name] = address
    target = Path(args.dir) / "cluster.toml"
    if target.exists():
        raise cluster_mod.ConfigError(f"{target} already exists; remove it or choose another directory")
    token = secrets.token_hex(24)
    doc = cluster_map.new_map(
        args.name,
        token,
        hosts,
        args.nodes_per_host,
        parse_size(args.capacity),
        args.data_root,
        base_port=args.base_port or 7400,
        max_slots_per_host=args.max_slots_per_host,
        lease_ttl_s=args.lease_ttl,
    )
    etcd = Etcd(args.etcd)
    try:
        revision = cluster_map.MapStore(etcd, args.name).create(doc)
    finally:
        etcd.close()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            "# kvtier cluster file (written by `kvstore init --etcd`): the map is in etcd; this file names it and\n"
            "# holds the admin token. Copy it (mode 0600) to every host and client.\n"
            + tomlkit.dumps({"cluster": {"name": args.name, "etcd": args.etcd, "token": token}}).rstrip("\n")
            + "\n"
        )
    nodes = len(doc["nodes"])
    print(
        f"wrote the map of cluster {args.name!r} to etcd (revision {revision}): {len(hosts)} hosts, {nodes} nodes, "
        f"{len(doc['groups'])} groups; and {target}. On each host: `kvstore serve {target} --host-id NAME`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
