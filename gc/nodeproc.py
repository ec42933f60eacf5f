"""The storage node process: a :mod:`kvtier.kvstore.node` server with its GC worker wired in.

``python -m kvtier.gc.nodeproc <cluster file> <node id>`` (what ``kvstore serve`` and
:class:`~kvtier.kvstore.local.LocalCluster` start). The node itself knows nothing about GC: this module
composes the two, so imports run one way (``gc`` → ``kvstore``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvtier.gc.evictor import Evictor
from kvtier.gc.worker import GCWorker
from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore import logs
from kvtier.kvstore.node import open_node, serve


def run_node(config_path: str, node_id: int) -> None:
    """Open the node, attach its GC worker, serve until SIGTERM/SIGINT."""
    logs.configure(node=node_id)
    node, server = open_node(config_path, node_id)
    evictor = Evictor(node.engine, node.config, node_id)
    worker = GCWorker(node.engine, node_id, node.config, lambda: node.ttl_classes, evictor=evictor)
    node.gc = worker
    node.engine.on_high_watermark = worker.wake
    node.engine.make_room = evictor.make_room
    serve(node, server, [worker.run])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvtier.gc.nodeproc", description="Run one storage node.")
    parser.add_argument("config", help="cluster file")
    parser.add_argument("node_id", type=int)
    args = parser.parse_args(argv)
    try:
        run_node(args.config, args.node_id)
    except cluster_mod.ConfigError as exc:
        sys.exit(f"kvstore node: {exc}")


if __name__ == "__main__":
    main()
