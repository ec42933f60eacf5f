"""``kvstore``: create a cluster file (``init``) and run its local nodes (``serve``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.local import serve
from kvtier.kvstore.units import parse_size


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore", description="kvtier block store: set up and run nodes.")
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write DIR/cluster.toml for a local cluster")
    init.add_argument("dir")
    init.add_argument("--nodes", type=int, default=12, help="number of nodes, a multiple of 12 (default 12)")
    init.add_argument("--capacity", default="2GiB", help="capacity per node, e.g. 2GiB (default)")
    init.add_argument("--base-port", type=int, default=None, help="first port (default: free ports)")
    run = sub.add_parser("serve", help="start every local node of a cluster file; Ctrl-C stops them")
    run.add_argument("config")
    args = parser.parse_args(argv)
    try:
        if args.command == "init":
            path = cluster_mod.write_default(
                args.dir, nodes=args.nodes, capacity_bytes=parse_size(args.capacity), base_port=args.base_port
            )
            print(f"wrote {path}: {args.nodes} nodes, {args.capacity} each; start them with `kvstore serve {path}`")
            return 0
        return serve(args.config)
    except (cluster_mod.ConfigError, ValueError) as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
