"""Membership: every node holds a lease in etcd and keeps it alive; a node whose lease lapses is marked down.

Runs in the etcd thread of a node process (``kvtier.gc.nodeproc``), beside the node's :class:`MapFeed`. A node's
membership key is written only by the process the map assigns the node to: the process keeps the place (host, port,
data dir) the map gave its node when it started (``placed``), and every write of its key is fenced on it.

Register (each node, for itself):

1. Grant a lease of the map's ``membership.lease_ttl_s``; put ``members/<id>`` (address, pid, start time, lease) on
   it, in a transaction guarded by the map's revision, having read in that revision that the map still places the
   node where this process runs. If it does not, the node was moved away (``kvctl node replace``): revoke the lease,
   stop renewing, and tell the node to stop (``on_moved``); never register again.
2. Unless the map already says so, mark this node ``up``: a map transaction guarded by ``members/<id>`` holding this
   process's value, so a node whose lease lapsed meanwhile, or whose key another process holds, is never marked up
   by it (nor is a node the map has moved).
3. Refresh the lease every third of its TTL, check that the key is still this process's (a key lost or taken means
   registering again: 1, fenced), and that the map still says ``up`` (2 again if not). While etcd cannot be reached
   the node keeps serving and keeps trying; once a whole TTL passed without a refresh, or a refresh finds the lease
   gone (it lapsed while this node was cut off), go back to 1: a node rejoins by itself when its partition heals,
   unless the map moved it meanwhile.

Every new map is checked too: one that places the node elsewhere stops the renewing at once (before the node stops
serving: ``on_moved``), so the old process of a moved node never holds its key while the new one runs.

Mark down (only the live member with the smallest id, so one writer at a time), whenever a member key goes and
every half TTL: every node the map says is ``up`` that has no ``members/`` key is marked ``down``, each by a map
transaction guarded by that key still not existing (a node that registered meanwhile stays up).

A node stopped cleanly revokes its lease (``close``), so it is marked down at once rather than a TTL later (unless
the map moved it: its node is another process's then).

Node states in the map:

| state | entered when | clients |
|---|---|---|
| new | ``kvstore init`` / ``kvctl group add`` / ``kvctl node replace`` wrote it | neither read from nor written to |
| up | it registered (step 2) | read from and written to (unless ``filling``: written to only) |
| down | its lease lapsed (mark down) or it stopped cleanly | neither: its shards are read around (parity) |

Failure cases:

| case | what happens |
|---|---|
| cut off from etcd, its lease lapses | marked down by the lowest live member; registers again (fenced) once healed |
| ... and the map moved its node meanwhile | registering finds it placed elsewhere (or the new map comes first): the |
| | renewing stops, its lease is revoked, the process stops; the replacement keeps the key |
| its key deleted or overwritten, its lease alive | the next refresh notices: it registers again (fenced) |
| stopped cleanly | lease revoked; marked down, unless the map moved the node |
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.kvstore.cluster.config import ClusterConfig
from kvtier.kvstore.cluster.etcd import ATTEMPT_S, EtcdUnavailable
from kvtier.kvstore.cluster.map import DEFAULT_LEASE_TTL_S, Doc, MapFeed, node_entry, place_of

log = logging.getLogger("kvtier.membership")


class Membership:
    """One node's registration and its share of marking others down (see the module docstring)."""

    def __init__(self, feed: MapFeed, node_id: int, on_moved: Callable[[], None] = lambda: None) -> None:
        """``on_moved``: called once (in the etcd thread) when the map places the node elsewhere than where this
        process runs; the renewing has stopped by then."""
        self.feed = feed
        self.store = feed.store
        self.etcd = feed.etcd
        self.node_id = node_id
        self.key = self.store.member_key(node_id)
        self.placed = place_of(feed.doc, node_id)  # where this process runs: what every write of its key is fenced on
        self.on_moved = on_moved
        self.registered = threading.Event()
        self.moved = threading.Event()
        self.lease_id: int | None = None
        self.value = b""  # what this process's key holds (unique to this process and lease)
        self.marked_down: list[tuple[int, float]] = []  # (node id, time) this node marked down
        self._kick: asyncio.Event | None = None
        feed.member_listeners.append(lambda: self._kick is not None and self.etcd.call_soon(self._kick.set))
        feed.listeners.append(self._check_placed)
        self._tasks = [self.etcd.spawn(self._keep()), self.etcd.spawn(self._mark_loop())]

    @property
    def lease_ttl_s(self) -> float:
        membership = self.feed.doc.get("membership") or {}
        return float(membership.get("lease_ttl_s", DEFAULT_LEASE_TTL_S))

    def _placed_here(self, doc: Doc) -> bool:
        return place_of(doc, self.node_id) == self.placed

    def _check_placed(self, _config: ClusterConfig) -> None:
        """A new map (in the etcd thread): one that moved the node stops the renewing, then the node."""
        if not self._placed_here(self.feed.doc):
            self._left()

    def _left(self) -> None:
        """The map moved the node: stop renewing (the tasks end, the lease is revoked), then tell the node. Once."""
        if self.moved.is_set():
            return
        self.moved.set()
        self.registered.clear()
        log.warning("node %d: the cluster map placed it elsewhere: it stops renewing its membership", self.node_id)
        for task in self._tasks:
            task.cancel()
        lease = self.lease_id
        if lease is not None:
            self.etcd.spawn(self._revoke(lease))
        self.on_moved()

    async def _revoke(self, lease: int) -> None:
        with contextlib.suppress(Exception):
            await self.etcd.run(lambda c: c.revoke_lease(lease), ATTEMPT_S * 2)

    async def _keep(self) -> None:
        """Steps 1-3 of the module docstring, for as long as the node runs (again half a second after a failure)."""

        async def registered() -> None:
            await self._register()
            await self._keep_alive()

        def failed(exc: Exception) -> None:
            self.registered.clear()
            log.warning("node %d: registering in etcd failed (%s); retrying", self.node_id, exc)

        await self.etcd.repeat(registered, lambda: 0.5, asyncio.Event(), failed)

    async def _register(self) -> None:
        ttl = self.lease_ttl_s
        lease = await self.etcd.run(lambda c: c.lease(max(2, math.ceil(ttl))), ATTEMPT_S * 2)
        node = self.feed.latest().nodes.get(self.node_id)
        info = {"host": node.host if node else "", "port": node.port if node else 0, "pid": os.getpid()}
        info.update(started=time.time(), lease=lease.id)
        value = json.dumps(info).encode()
        if not await self.etcd.run(lambda c: self._claim(c, value, lease.id), ATTEMPT_S * 2):
            self.lease_id = lease.id
            self._left()
            return
        self.lease_id, self.value = lease.id, value
        await self._ensure_up()
        self.registered.set()
        log.info("node %d registered (lease %x, ttl %gs)", self.node_id, lease.id, ttl)

    async def _claim(self, c: Any, value: bytes, lease: int) -> bool:
        """Put this process's key on ``lease`` if the map still places the node here, in one transaction guarded by
        the revision in which that was read; False (nothing written) if the map places it elsewhere."""
        for _ in range(50):
            doc, revision = await self.store.aread(c)
            if not self._placed_here(doc):
                return False
            ok, _ = await c.transaction(
                compare=[c.transactions.mod(self.store.map_key) == revision],
                success=[c.transactions.put(self.key, value, lease=lease)],
                failure=[],
            )
            if ok:
                return True
        raise EtcdUnavailable(f"the map kept changing while node {self.node_id} registered; retrying")

    async def _keep_alive(self) -> None:
        """Refresh until the lease is gone, a whole TTL passed without a refresh (it lapsed at etcd), or the key is
        no longer this process's."""
        ttl = self.lease_ttl_s
        refreshed = time.monotonic()
        while not self.etcd.closed and not self.moved.is_set():
            await asyncio.sleep(ttl / 3)
            try:
                reply = await self.etcd.run(lambda c: c.refresh_lease(self.lease_id), ttl / 3)
                held = await self.etcd.run(lambda c: c.get(self.key), ttl / 3) if reply and reply.TTL > 0 else None
            except EtcdUnavailable as exc:
                if time.monotonic() - refreshed > ttl:
                    log.warning("node %d: no lease refresh for %.1fs (%s): registering again", self.node_id, ttl, exc)
                    self.registered.clear()
                    return
                continue
            if reply is None or reply.TTL <= 0:
                log.warning("node %d: its lease lapsed: registering again", self.node_id)
                self.registered.clear()
                return
            if held is None or held.value != self.value:
                log.warning("node %d: its membership key was lost or taken: registering again", self.node_id)
                self.registered.clear()
                return
            refreshed = time.monotonic()
            await self._ensure_up()

    async def _ensure_up(self) -> None:
        node = self.feed.latest().nodes.get(self.node_id)
        if node is not None and node.state == "up":
            return
        mark_up = set_state(self.node_id, "up", self._placed_here)
        await self.etcd.run(
            lambda c: self.store.aupdate(c, mark_up, lambda c: [c.transactions.value(self.key) == self.value]),
            ATTEMPT_S * 2,
        )

    async def _mark_loop(self) -> None:
        self._kick = asyncio.Event()

        def failed(exc: Exception) -> None:
            log.info("node %d: marking lapsed nodes down failed (%s); retrying", self.node_id, exc)

        await self.etcd.repeat(self._mark_down, lambda: self.lease_ttl_s / 2, self._kick, failed)

    async def _mark_down(self) -> None:
        live = set(self.feed.members)
        if not self.registered.is_set() or self.node_id not in live or min(live) != self.node_id:
            return
        for nid, node in self.feed.latest().nodes.items():
            if node.state != "up" or nid in live:
                continue
            key, mark = self.store.member_key(nid), set_state(nid, "down")
            await self.etcd.run(
                lambda c, key=key, mark=mark: self.store.aupdate(c, mark, lambda c: [c.transactions.version(key) == 0]),
                ATTEMPT_S * 2,
            )
            self.marked_down.append((nid, time.time()))
            log.warning("node %d: marked node %d down (its lease lapsed)", self.node_id, nid)

    def close(self) -> None:
        """Leave: revoke the lease (the node is marked down at once, unless the map moved it: another process's
        then) and stop."""
        for task in self._tasks:
            task.cancel()
        lease = self.lease_id
        if lease is not None:

            async def leave(c: Any) -> None:
                await c.revoke_lease(lease)
                guard = [c.transactions.version(self.key) == 0]
                await self.store.aupdate(c, set_state(self.node_id, "down", self._placed_here), lambda c: guard)

            with contextlib.suppress(Exception):
                self.etcd.call(leave, timeout_s=3.0)


def set_state(node_id: int, state: str, only_if: Callable[[Doc], bool] = lambda doc: True) -> Callable[[Doc], bool]:
    """A map edit (``MapStore.update``) setting ``node_id``'s state; no change if it has that state already, or if
    ``only_if(map)`` is false (a process sets its own node's state only while the map places the node there)."""

    def edit(doc: Doc) -> bool:
        entry = node_entry(doc, node_id)
        if entry["state"] == state or not only_if(doc):
            return False
        entry["state"] = state
        return True

    return edit
