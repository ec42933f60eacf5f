"""Filling a replaced node by repair (etcd maps only), rate-limited, with its progress in etcd.

``kvctl node replace ID --host H`` moves a node to another host with an empty data dir and marks it ``filling``
with a fresh token (the map's ``nodes[].filling``). While it fills, clients write to it but read around it (its
shards are parity's to replace), so reads stay correct throughout. Every node process runs a :class:`Filler`:

1. On every new map, and every ``check_s``: the fills this node owes are the tokens of nodes that are ``up`` and
   ``filling``, share a placement group with it, and are not covered by this node's last finished pass.
2. If it owes any: one full repair pass (``Repairer.full_pass``): every block whose record is held here (acted on
   by the first holder of shards 0-2 that still keeps it) is surveyed on its 12 nodes and its missing shards are
   rewritten, at most ``gc.repair_bytes_per_s``. After each batch of blocks ``progress/<id>`` in
   etcd says ``{"fills": this pass's tokens, "covered": tokens, "checked", "total", "repaired", "done": false}``;
   at the end ``done`` is true. ``covered`` is every token still in the map that a finished pass of this node
   covered (the tokens of this pass once it is done): a later pass for another fill does not hide an earlier one.
3. A fill is complete once every node that is ``up`` in the filling node's groups (itself excepted) has a finished
   pass covering its token (it is in their ``covered``): then its ``filling`` is cleared, by a map transaction that
   checks the token is still the node's (any node may do it; the first wins, the others find nothing to change).
   Reads use it again.

``kvctl map`` shows the progress. A node down during the fill does not hold it up (its blocks' other record
holder repairs them); one that comes back later finds its shards rewritten by the next pass anyone makes.

A growth (``kvctl group add``) is filled the same way, with a token of its own (the map's ``growth``): it keeps the
groups from before it (``previous_groups``); clients look for a block where those put it when the new groups do
not have it yet (reads, ``match`` and deletes), and in step 2 each node of an old group first **moves** the blocks
it is primary for that the new groups place elsewhere: read whole from the old group, written with all 12 shards
(their header digest, TTL class and creation time kept) to the new one, checked there, then deleted from the old
nodes that do not hold them in the new placement. Once every node of the old groups has finished such a pass,
``previous_groups`` and ``growth`` are cleared (step 3) and clients look only where the new groups say.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import numpy as np

from kvtier.gc.worker import GCWorker
from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster.etcd import EtcdUnavailable
from kvtier.kvstore.cluster.map import Doc, MapFeed, node_entry
from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.placement import Placement

log = logging.getLogger("kvtier.fill")

MOVE_BATCH = 64  # blocks read whole and written to their new group at a time


class Filler:
    """This node's part in filling replaced nodes (see the module docstring)."""

    def __init__(self, feed: MapFeed, worker: GCWorker, node_id: int, check_s: float = 2.0) -> None:
        self.feed = feed
        self.worker = worker
        self.node_id = node_id
        self.check_s = check_s
        self.covered: set[str] = set()  # fill tokens this node's finished passes covered
        self._wake = threading.Event()
        feed.listeners.append(lambda _config: self._wake.set())

    def run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            self._wake.wait(self.check_s)
            self._wake.clear()
            if stopping.is_set():
                return
            try:
                self.step()
            except EtcdUnavailable as exc:
                log.info("node %d: fill step postponed: %s", self.node_id, exc)
            except Exception:
                log.exception("node %d: fill step failed", self.node_id)

    def step(self) -> None:
        """Steps 1-3 of the module docstring, once."""
        doc = self.feed.doc
        owed = self._owed(doc)
        if owed:
            self._pass(owed)
        self._complete(doc)

    def _owed(self, doc: Doc) -> set[str]:
        mine = [set(g) for g in doc["groups"] if self.node_id in g]
        fills = {
            n["filling"]
            for n in doc["nodes"]
            if n["filling"] and n["state"] == "up" and n["id"] != self.node_id and any(n["id"] in g for g in mine)
        }
        if doc.get("growth") and any(self.node_id in g for g in doc["previous_groups"]) and self._new_groups_up(doc):
            fills.add(doc["growth"])
        return fills - self.covered

    @staticmethod
    def _new_groups_up(doc: Doc) -> bool:
        """Every node of the groups a growth added is up (a move waits for them: they take the blocks)."""
        new = {n for g in doc["groups"] if g not in doc["previous_groups"] for n in g}
        return all(n["state"] == "up" for n in doc["nodes"] if n["id"] in new)

    def _pass(self, tokens: set[str]) -> None:
        log.info("node %d: repair pass to fill %s", self.node_id, sorted(tokens))
        started = time.time()

        last = [0, -1, 0]  # what the pass said last: checked, total, repaired

        def progress(checked: int, total: int, repaired: int, done: bool = False) -> None:
            last[:] = [checked, total, repaired]
            covered = self.covered & _tokens(self.feed.doc)
            record = {"fills": sorted(tokens), "covered": sorted(covered), "checked": checked, "total": total}
            record.update(repaired=repaired, done=done, started=started, at=time.time())
            self._publish(record)

        progress(0, -1, 0)
        config = self.feed.latest()
        if config.previous_groups:
            with Mover(self.worker) as mover:
                mover.move(Placement(config.previous_groups), progress)
        self.worker.repairer.full_pass(progress=progress)
        self.covered |= tokens
        progress(*last, done=True)

    def _publish(self, record: dict[str, Any]) -> None:
        key = f"{self.feed.store.progress}{self.node_id}".encode()
        try:
            self.feed.etcd.call(lambda c: c.put(key, json.dumps(record).encode()), timeout_s=5.0)
        except EtcdUnavailable as exc:
            log.info("node %d: repair progress not published: %s", self.node_id, exc)

    def _complete(self, doc: Doc) -> None:
        filling = [n for n in doc["nodes"] if n["filling"] and n["state"] == "up"]
        if not filling and not doc.get("growth"):
            return
        progress = read_progress(self.feed)
        if doc.get("growth"):
            self._complete_growth(doc, progress)
        for node in filling:
            token = node["filling"]
            peers = {p for g in doc["groups"] if node["id"] in g for p in g} - {node["id"]}
            up = {n["id"] for n in doc["nodes"] if n["id"] in peers and n["state"] == "up"}
            if not all(_covers(progress.get(p, {}), token) for p in up):
                continue

            def clear(doc: Doc, nid: int = node["id"], token: str = token) -> bool:
                entry = node_entry(doc, nid)
                if entry["filling"] != token:
                    return False
                entry["filling"] = False
                return True

            revision = self.feed.store.update(clear)
            log.info("node %d: node %d is filled (map revision %d)", self.node_id, node["id"], revision)

    def _complete_growth(self, doc: Doc, progress: dict[int, dict[str, Any]]) -> None:
        token = doc["growth"]
        old = {n for g in doc["previous_groups"] for n in g}
        up = {n["id"] for n in doc["nodes"] if n["id"] in old and n["state"] == "up"}
        if not all(_covers(progress.get(p, {}), token) for p in up):
            return

        def settle(doc: Doc) -> bool:
            if doc.get("growth") != token:
                return False
            doc["previous_groups"], doc["growth"] = [], ""
            return True

        revision = self.feed.store.update(settle)
        log.info("node %d: the growth's blocks have moved (map revision %d)", self.node_id, revision)


class Mover:
    """Step 2 of a growth at one node of an old group (see the module docstring), over the GC worker's engine and
    an admin client of its own: a client is one thread's (its connections, the tenant it acts for, the placement it
    places by), and the GC worker's thread uses the worker's at the same time (its cycles placed blocks by the old
    groups while a move did, and read each other's replies: "take_head() is only allowed between frames", a block
    lost in a growth). No lock is held across a batch: a block evicted while it moves may be kept in its new group
    (never wrong bytes: a key names its contents). Close it (``with``) when the move is done."""

    def __init__(self, worker: GCWorker) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.client = Client(worker.config)  # the cluster token: admin, may act for any tenant
        self.config = worker.config
        self.node_id = worker.node_id

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def move(self, previous: Placement, progress: Callable[[int, int, int], None] | None = None) -> int:
        """Move the blocks this node is primary for under ``previous`` (the groups before a growth) that the current
        groups place elsewhere: each read whole from its old group, written with all 12 shards (header, class and
        creation time kept) to its new one, checked there, then deleted from the old nodes the new placement does
        not use; at most ``repair_bytes_per_s``. Returns blocks moved (``gc.fill``, docs/design.md §10)."""
        current = self.client.placement
        by_tenant: dict[str, list[tuple[bytes, float, str]]] = {}
        for bkey, record in self.engine.records_held():
            ((tenant, key),) = self.engine.block_keys_to_pairs([bkey])
            by_tenant.setdefault(tenant, []).append((key, record.created, record.ttl_class))
        total = sum(map(len, by_tenant.values()))
        checked = moved = 0
        for tenant, blocks in by_tenant.items():
            with self.client.acting_for(tenant):
                for start in range(0, len(blocks), MOVE_BATCH):
                    batch = blocks[start : start + MOVE_BATCH]
                    began = time.perf_counter()
                    moved_bytes, count = self._move_batch(batch, previous, current)
                    moved += count
                    checked += len(batch)
                    rate = self.config.gc.repair_bytes_per_s
                    time.sleep(max(0.0, (moved_bytes / rate if rate > 0 else 0.0) - (time.perf_counter() - began)))
                    if progress is not None:
                        progress(checked, total, moved)
        return moved

    def _move_batch(
        self, blocks: list[tuple[bytes, float, str]], previous: Placement, current: Placement
    ) -> tuple[int, int]:
        keys = [key for key, _, _ in blocks]
        old, new = previous.shard_nodes(keys), current.shard_nodes(keys)
        rows = np.flatnonzero((old[:, 0] == self.node_id) & (old != new).any(axis=1))
        if not len(rows):
            return 0, 0
        keys = [keys[r] for r in rows.tolist()]
        with self.client.placed_by(previous):
            found = self.client.read_for_repair(keys)
        have = [j for j, f in enumerate(found) if f is not None]
        by_class: dict[str, list[int]] = {}
        for j in have:
            by_class.setdefault(blocks[rows[j]][2], []).append(j)
        moved_bytes = 0
        for ttl_class, js in by_class.items():
            data = [found[j] for j in js]
            self.client.write_shards(
                [keys[j] for j in js],
                [d.data for d in data],  # type: ignore[union-attr]
                ttl_class,
                np.ones((len(js), TOTAL_SHARDS), dtype=bool),
                [d.header for d in data],  # type: ignore[union-attr]
                created=[blocks[rows[j]][1] for j in js],
            )
            moved_bytes += sum(len(d.data) for d in data)  # type: ignore[union-attr]
        present = self.client.probe([keys[j] for j in have]) if have else np.zeros((0, TOTAL_SHARDS), dtype=bool)
        arrived = [keys[j] for j, ok in zip(have, present[:, 0] & (present.sum(axis=1) >= 11), strict=True) if ok]
        if arrived:
            self._delete_old(arrived, previous, current)
        return moved_bytes, len(arrived)

    def _delete_old(self, keys: list[bytes], previous: Placement, current: Placement) -> None:
        """Delete moved blocks' shards and records from the old nodes that the new placement does not use."""
        old, new = previous.shard_nodes(keys), current.shard_nodes(keys)
        for node_id in np.unique(old).tolist():
            rows = np.flatnonzero((old == node_id).any(axis=1) & ~(new == node_id).any(axis=1))
            if len(rows):
                with self.client.placed_by(previous):
                    self.client.delete_on(node_id, [keys[r] for r in rows.tolist()])


def _tokens(doc: Doc) -> set[str]:
    """The fills the map still has open: the filling nodes' tokens and a growth's."""
    return {n["filling"] for n in doc["nodes"] if n["filling"]} | ({doc["growth"]} if doc.get("growth") else set())


def _covers(record: dict[str, Any], token: str) -> bool:
    """Whether a node's progress record says a finished pass of it covered ``token``."""
    return token in record.get("covered", [])


def read_progress(feed: MapFeed) -> dict[int, dict[str, Any]]:
    """Every node's last published repair progress (``progress/<id>``), by node id."""
    prefix = feed.store.progress.encode()
    found = feed.etcd.call(lambda c: c.get_prefix(prefix), timeout_s=5.0)
    out = {}
    for kv in found:
        try:
            out[int(kv.key.rsplit(b"/", 1)[1])] = json.loads(kv.value)
        except ValueError:
            continue
    return out
