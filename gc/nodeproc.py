"""The storage node process: a :mod:`kvtier.kvstore.node.server` server with its GC worker wired in.

``python -m kvtier.gc.nodeproc <cluster file> <node id>`` (what ``kvstore serve`` and
:class:`~kvtier.kvstore.cluster.local.LocalCluster` start). The node itself knows nothing about GC: this module
composes the two, so imports run one way (``gc`` → ``kvstore``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence

from kvtier.gc.evictor import Evictor
from kvtier.gc.fill import Filler
from kvtier.gc.worker import GCWorker
from kvtier.kvstore import logs
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import NEEDS_RESET_EXIT, NODE_ERROR_PREFIX
from kvtier.kvstore.cluster.map import MapFeed
from kvtier.kvstore.cluster.membership import Membership
from kvtier.kvstore.node.chunks import MetadataError
from kvtier.kvstore.node.disk import NoSpace
from kvtier.kvstore.node.server import open_node, serve

log = logging.getLogger("kvtier.node")


def run_node(
    config_path: str,
    node_id: int,
    etcd: str | None = None,
    fallback_log_fd: int | None = None,
    end_with_stdin: bool = False,
) -> None:
    """Open the node, attach its GC worker, serve until SIGTERM/SIGINT (or, ``end_with_stdin``, until stdin ends:
    the process that started the node and holds its other end is gone). With an etcd map: register (and keep the
    lease alive), follow the map, leave when stopped (``kvstore.cluster.membership``). Log lines its log (stderr)
    cannot take go to ``fallback_log_fd``."""
    logs.configure(fallback_log_fd, node=node_id)
    node, server = open_node(config_path, node_id, etcd)
    if end_with_stdin:
        threading.Thread(target=_stop_when_it_ends, args=(sys.stdin.fileno(), server.stop), daemon=True).start()
    evictor = Evictor(node.engine, node.config, node_id)
    worker = GCWorker(
        node.engine,
        node_id,
        node.config,
        lambda: node.ttl_classes,
        evictor=evictor,
        on_restored=node.metrics.redundancy_restored,
    )
    node.gc = worker
    node.engine.on_high_watermark = node.engine.on_unconfirmed = worker.wake
    node.engine.make_room = evictor.make_room
    feed = node.config.feed
    if not isinstance(feed, MapFeed):  # a cluster file: the map never changes
        serve(node, server, [worker.run, worker.repairer.run, worker.scrubber.run])
        return
    feed.listeners.append(node.adopt)
    feed.listeners.append(worker.adopt)
    placed = node.config.nodes[node_id]

    def leave() -> None:  # `kvctl node replace` put this node elsewhere; its membership has stopped renewing
        log.warning("the cluster map moved node %d away from %s:%d: stopping", node_id, placed.host, placed.port)
        threading.Thread(target=server.stop, daemon=True).start()

    membership = Membership(feed, node_id, on_moved=leave)
    filler = Filler(feed, worker, node_id)
    try:
        serve(node, server, [worker.run, worker.repairer.run, worker.scrubber.run, filler.run])
    finally:
        membership.close()
        feed.close()


def _stop_when_it_ends(fd: int, stop: Callable[[], None]) -> None:
    """Read ``fd`` (stdin) to its end, then ``stop``. Raw reads: a daemon thread blocked in ``sys.stdin``'s buffered
    read holds its lock, and a node exiting meanwhile (it could not bind) aborted at interpreter shutdown
    ("could not acquire lock for <_io.BufferedReader name='<stdin>'>", exit -6) instead of exiting with its error."""
    while os.read(fd, 4096):
        pass
    log.warning("stdin ended (the process that started this node is gone): stopping")
    stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvtier.gc.nodeproc", description="Run one storage node.")
    parser.add_argument("config", help="cluster file")
    parser.add_argument("node_id", type=int)
    parser.add_argument("--etcd", default=None, help="etcd endpoints (instead of the cluster file's)")
    parser.add_argument(
        "--fallback-log-fd", type=int, default=None, help="where log lines go that stderr (the log) cannot take"
    )
    parser.add_argument(
        "--end-with-stdin", action="store_true", help="stop when stdin ends (its writer, the starting process, is gone)"
    )
    args = parser.parse_args(argv)
    try:
        run_node(args.config, args.node_id, args.etcd, args.fallback_log_fd, args.end_with_stdin)
    except cluster_mod.ConfigError as exc:
        sys.exit(f"{NODE_ERROR_PREFIX}{exc}")
    except NoSpace as exc:  # a data dir that must be written to be opened, on a disk with no room
        sys.exit(f"{NODE_ERROR_PREFIX}node {args.node_id} cannot start: {exc}; free room on its disk")
    except MetadataError as exc:  # not restarted by `kvstore serve` until reset: it would fail the same way
        print(
            f"{NODE_ERROR_PREFIX}node {args.node_id}: {exc}; move its data aside and start it empty with "
            f"`kvstore reset-node {args.config} {args.node_id}` (repair then refills it)",
            file=sys.stderr,
        )
        sys.exit(NEEDS_RESET_EXIT)
    except OSError as exc:  # e.g. its metrics port in use: the cause in one line, not a traceback
        sys.exit(f"{NODE_ERROR_PREFIX}node {args.node_id} cannot start: {exc}")


if __name__ == "__main__":
    main()
