"""The cluster map in etcd: one versioned document under one prefix, changed only by compare-and-swap.

Without etcd a cluster is its cluster file (``kvstore.cluster.config``). With etcd the cluster file is small — the
cluster's name, a token and the etcd endpoints (``[cluster] etcd = "http://10.0.0.1:2379,..."``) — and everything
else is the **map**, a JSON document at ``/kvtier/<name>/map``::

    {"format": 1, "name": "prod", "hash": "xxh3_128", "max_slots_per_host": 2,
     "hosts": {"h0": "10.0.0.10", ...},                         # failure domains and the address their nodes bind
     "nodes": [{"id": 0, "host": "h0", "port": 7400, "data_dir": "/srv/kvtier/node-0", "capacity": 2147483648,
                "metrics_port": 0, "state": "up", "filling": false}, ...],
     "groups": [[0, 2, 4, ...]],                                 # placement groups of 12 node slots
     "previous_groups": [], "growth": "",                        # the groups before a growth, until it has moved
     "ttl": {"agent": 259200, ...}, "gc": {...}, "client": {...}, "limits": {...},
     "membership": {"lease_ttl_s": 5.0},
     "tenants": {"default": "sha256:...", ...}}                  # tokens' hashes, never the tokens

Beside it, ``members/<node id>`` (one key per running node, on that node's lease: ``kvstore.cluster.membership``) and
``progress/<node id>`` (repair progress). The map's **revision** is the etcd ``mod_revision`` of its key: every
change is one transaction comparing it (``MapStore.update``), so two editors never lose each other's change, and a
process knows exactly which version it acts on (``ClusterConfig.revision``).

``load(path)`` reads either kind of cluster file. For an etcd one it returns the map as a ``ClusterConfig`` whose
``feed`` (:class:`MapFeed`) watches the prefix and keeps the newest map: clients and nodes adopt it between calls.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import tomllib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.config import ClusterConfig, ConfigError, token_hash
from kvtier.kvstore.cluster.etcd import ATTEMPT_S, Compacted, Etcd, EtcdUnavailable, stopping
from kvtier.kvstore.codec import PARITY_SHARDS, TOTAL_SHARDS

if TYPE_CHECKING:
    import aetcd

log = logging.getLogger("kvtier.map")

MAP_FORMAT = 1
NODE_STATES = ("new", "up", "down")
DEFAULT_LEASE_TTL_S = 5.0
Doc = dict[str, Any]


# --- the document -------------------------------------------------------------------------------------------


def new_map(
    name: str,
    admin_token: str,
    hosts: dict[str, str],
    nodes_per_host: int,
    capacity_bytes: int,
    data_root: str,
    base_port: int = 7400,
    max_slots_per_host: int = PARITY_SHARDS,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
) -> Doc:
    """A map of ``nodes_per_host`` nodes on each host, grouped so that no host holds more than ``max_slots_per_host``
    slots of a group (ConfigError, one line, when that cannot be done). Node ids run host by host; on each host
    node ``k`` listens on ``base_port + k`` (metrics on ``base_port + 1000 + k``) and keeps its data in
    ``data_root/node-<id>``. Every node starts ``new``: it is ``up`` once it has registered."""
    if nodes_per_host <= 0 or (len(hosts) * nodes_per_host) % TOTAL_SHARDS:
        raise ConfigError(
            f"{len(hosts)} hosts × {nodes_per_host} nodes is not a multiple of {TOTAL_SHARDS} nodes "
            f"(each placement group has {TOTAL_SHARDS} slots)"
        )
    nodes = []
    for h, host in enumerate(hosts):
        for k in range(nodes_per_host):
            nid = h * nodes_per_host + k
            nodes.append(_node_entry(nid, host, base_port + k, f"{data_root.rstrip('/')}/node-{nid}", capacity_bytes))
            nodes[-1]["metrics_port"] = base_port + 1000 + k
    doc: Doc = {
        "format": MAP_FORMAT,
        "name": name,
        "hash": "xxh3_128",
        "max_slots_per_host": max_slots_per_host,
        "hosts": dict(hosts),
        "nodes": nodes,
        "groups": [],
        "previous_groups": [],
        "growth": "",
        "ttl": dict(cluster_mod.DEFAULT_TTL_CLASSES),
        "gc": {},
        "client": {},
        "limits": {},
        "membership": {"lease_ttl_s": lease_ttl_s},
        "tenants": {cluster_mod.DEFAULT_TENANT: token_hash(admin_token)},
    }
    doc["groups"] = spread_groups(doc, [n["id"] for n in nodes])
    check_map(doc)
    return doc


def _node_entry(nid: int, host: str, port: int, data_dir: str, capacity_bytes: int) -> Doc:
    return {
        "id": nid,
        "host": host,
        "port": port,
        "data_dir": data_dir,
        "capacity": capacity_bytes,
        "metrics_port": 0,
        "state": "new",
        "filling": False,
    }


def spread_groups(doc: Doc, node_ids: Sequence[int]) -> list[list[int]]:
    """``node_ids`` (a multiple of 12) as placement groups, each taking its nodes round-robin over the hosts, so a
    host's slots in a group are as few as the hosts allow."""
    by_host: dict[str, list[int]] = {}
    host_of = {n["id"]: n["host"] for n in doc["nodes"]}
    for nid in node_ids:
        by_host.setdefault(host_of[nid], []).append(nid)
    order: list[int] = []
    queues = [list(q) for q in by_host.values()]
    while any(queues):
        for queue in queues:
            if queue:
                order.append(queue.pop(0))
    return [order[i : i + TOTAL_SHARDS] for i in range(0, len(order), TOTAL_SHARDS)]


def check_map(doc: Doc) -> None:
    """Everything a cluster file's loading checks, and: known hosts, one (address, port) per node, node states, and
    no group with more than ``max_slots_per_host`` slots on one host. ConfigError (one line) otherwise."""
    config_from_map(doc, "x" * cluster_mod.MIN_TOKEN_CHARS, 0)  # a stand-in token: the map holds only hashes
    hosts = doc.get("hosts")
    if not isinstance(hosts, dict) or not hosts:
        raise ConfigError("the map lists no hosts")
    seen: set[tuple[str, int]] = set()
    host_of: dict[int, str] = {}
    for node in doc["nodes"]:
        if node.get("host") not in hosts:
            raise ConfigError(f"node {node.get('id')} is on unknown host {node.get('host')!r}")
        if node.get("state") not in NODE_STATES:
            raise ConfigError(f"node {node['id']}: state must be one of {', '.join(NODE_STATES)}")
        where = (hosts[node["host"]], node["port"])
        if where in seen:
            raise ConfigError(f"node {node['id']}: {where[0]}:{where[1]} is taken by another node")
        seen.add(where)
        host_of[node["id"]] = node["host"]
    most = doc.get("max_slots_per_host", PARITY_SHARDS)
    for g, group in enumerate([*doc["groups"], *doc.get("previous_groups", [])]):
        host, count = Counter(host_of[n] for n in group).most_common(1)[0]
        if count > most:
            raise ConfigError(
                f"group {g} would put {count} of its {TOTAL_SHARDS} slots on host {host!r}: losing that host would "
                f"lose {count} shards of its blocks, and 10+2 survives {PARITY_SHARDS}; spread the group over more "
                f"hosts (at most {most} slots a host), or allow more with --max-slots-per-host"
            )


def config_from_map(
    doc: Doc, token: str, revision: int, feed: MapFeed | None = None, path: Path | None = None
) -> ClusterConfig:
    """The map as the ClusterConfig every part of kvtier takes (validated as a cluster file is); ConfigError."""
    try:
        hosts = doc["hosts"]
        nodes = doc["nodes"]
        table = {
            "cluster": {"token": token, "name": doc["name"], "hash": doc.get("hash", "xxh3_128")},
            "nodes": [
                {
                    "id": n["id"],
                    "host": hosts.get(n["host"], "?"),
                    "port": n["port"],
                    "data_dir": n["data_dir"],
                    "capacity": n["capacity"],
                    "metrics_port": n.get("metrics_port", 0),
                }
                for n in nodes
            ],
            "groups": [{"nodes": g} for g in doc["groups"]],
            **{k: doc[k] for k in ("ttl", "gc", "client", "limits") if doc.get(k) is not None},
        }
        tenants = dict(doc["tenants"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"the cluster map is malformed (missing or bad {exc})") from None
    if doc.get("format") != MAP_FORMAT:
        raise ConfigError(f"the cluster map has format {doc.get('format')!r}; this kvtier reads format {MAP_FORMAT}")
    config = cluster_mod.parse(table, base_dir=Path("/"), path=path)
    extra = {n["id"]: n for n in nodes}
    return replace(
        config,
        nodes={
            nid: replace(
                node, host_id=extra[nid]["host"], state=extra[nid]["state"], filling=bool(extra[nid]["filling"])
            )
            for nid, node in config.nodes.items()
        },
        previous_groups=[list(g) for g in doc.get("previous_groups", [])],
        tenants=tenants,
        revision=revision,
        feed=feed,
    )


Place = tuple[str, int, str] | None
"""Where the map places a node: (host name, port, data dir), None when it has no such node."""


def place_of(doc: Doc, node_id: int) -> Place:
    """Where ``doc`` places ``node_id`` (a process of the node runs only there: ``kvstore.cluster.membership``)."""
    for node in doc.get("nodes", []):
        if node.get("id") == node_id:
            return (node.get("host"), node.get("port"), node.get("data_dir"))
    return None


def node_entry(doc: Doc, node_id: int) -> Doc:
    """The map's entry of ``node_id``; ConfigError if there is none."""
    for node in doc["nodes"]:
        if node["id"] == node_id:
            return node  # type: ignore[no-any-return]
    raise ConfigError(f"node {node_id} is not in the cluster map")


# --- etcd ---------------------------------------------------------------------------------------------------


class MapStore:
    """The map's keys in etcd (see the module docstring). Every method may raise ``EtcdUnavailable``."""

    def __init__(self, etcd: Etcd, name: str) -> None:
        if not name or "/" in name:
            raise ConfigError(f"cluster name {name!r} must be non-empty and hold no '/'")
        self.etcd = etcd
        self.name = name
        self.prefix = f"/kvtier/{name}/"
        self.map_key = (self.prefix + "map").encode()
        self.members = self.prefix + "members/"
        self.progress = self.prefix + "progress/"

    def member_key(self, node_id: int) -> bytes:
        return f"{self.members}{node_id}".encode()

    def read(self) -> tuple[Doc, int]:
        """The map and its revision; ConfigError if the cluster has none."""
        return self.etcd.call(self.aread)

    async def aread(self, client: aetcd.Client) -> tuple[Doc, int]:
        got = await client.get(self.map_key)
        if got is None:
            raise ConfigError(f"etcd at {self.etcd.where} holds no map for cluster {self.name!r} (kvstore init --etcd)")
        return _decode(got.value), got.mod_revision

    def create(self, doc: Doc) -> int:
        """Write a new map; ConfigError if the cluster has one already (it is never overwritten)."""
        check_map(doc)

        async def create(client: aetcd.Client) -> int:
            ok, replies = await client.transaction(
                compare=[client.transactions.create(self.map_key) == 0],
                success=[client.transactions.put(self.map_key, _encode(doc))],
                failure=[],
            )
            if not ok:
                raise ConfigError(f"cluster {self.name!r} already has a map in etcd at {self.etcd.where}")
            return int(replies[0].response_put.header.revision)

        return self.etcd.call(create)

    def update(self, edit: Callable[[Doc], bool], guards: Callable[[aetcd.Client], list[Any]] | None = None) -> int:
        """Change the map: ``edit`` changes a copy in place and says whether it changed anything; the copy is checked
        (ConfigError, nothing written) and written if the map is still the one read (else read again and retried).
        ``edit`` may run more than once, each time on the newest map, so it must decide from what it is given.
        Returns the map's revision afterwards."""
        return self.etcd.call(lambda client: self.aupdate(client, edit, guards))

    async def aupdate(
        self,
        client: aetcd.Client,
        edit: Callable[[Doc], bool],
        guards: Callable[[aetcd.Client], list[Any]] | None = None,
    ) -> int:
        """``update`` from the loop. ``guards(client)``: more comparisons the write needs; when one fails (and the
        map did not change meanwhile) nothing is written and the current revision is returned."""
        for _ in range(50):
            doc, revision = await self.aread(client)
            changed = copy.deepcopy(doc)
            if not edit(changed):
                return revision
            check_map(changed)
            compare = [client.transactions.mod(self.map_key) == revision, *(guards(client) if guards else [])]
            ok, replies = await client.transaction(
                compare=compare, success=[client.transactions.put(self.map_key, _encode(changed))], failure=[]
            )
            if ok:
                return int(replies[0].response_put.header.revision)
            if guards is not None and (await self.aread(client))[1] == revision:
                return revision  # a guard failed, not the map: nothing to do
        raise EtcdUnavailable(f"the map of {self.name!r} kept changing under this edit; try again")


def _encode(doc: Doc) -> bytes:
    return json.dumps(doc, sort_keys=True).encode()


def _decode(raw: bytes) -> Doc:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"the cluster map in etcd is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError("the cluster map in etcd is not a JSON object")
    return doc


# --- loading either kind of cluster file ----------------------------------------------------------------------


def read_etcd_file(path: str | Path) -> tuple[str, str, str] | None:
    """(endpoints, cluster name, token) of a cluster file that names etcd, or None for a self-contained one."""
    path = Path(path)
    text, mode = cluster_mod._read(path)  # ConfigError for a missing or unreadable file
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster file {path} is not valid TOML: {exc}") from None
    cluster = doc.get("cluster")
    if not isinstance(cluster, dict) or "etcd" not in cluster:
        return None
    fields = [cluster.get("etcd"), cluster.get("name"), cluster.get("token")]
    if not all(isinstance(f, str) and f for f in fields):
        raise ConfigError(f"{path}: an etcd cluster file needs [cluster] etcd, name and token (strings)")
    cluster_mod.check_private(path, mode)
    return fields[0], fields[1], fields[2]  # type: ignore[return-value]


def load(path: str | Path, etcd_endpoints: str | None = None, watch: bool = True) -> ClusterConfig:
    """The cluster a cluster file describes: the file itself (``cluster.config.load``: nodes and admin tools), or,
    when it names etcd (``etcd_endpoints`` overrides the endpoints), the map in etcd with a :class:`MapFeed` keeping it
    current (``watch=False``: one read). ConfigError (one line) for a bad file, a missing map, a token that is not the
    cluster's, or etcd unreachable."""
    return _load(path, etcd_endpoints, watch, cluster_mod.load, lambda file_token: file_token)


def load_client(path: str | Path, token: str | None = None, etcd_endpoints: str | None = None) -> ClusterConfig:
    """:func:`load` as a client uses it (``cluster.config.load_client``): the cluster file or its token-free client
    file, presenting ``token``, else ``$KVTIER_TOKEN``, else the file's own token."""
    return _load(
        path,
        etcd_endpoints,
        True,
        lambda p: cluster_mod.load_client(p, token),
        lambda file_token: token or os.environ.get(cluster_mod.TOKEN_ENV) or file_token,
    )


def load_verifier(path: str | Path, token: str | None = None) -> ClusterConfig:
    """The cluster as a server sees it that authenticates tenants without holding their tokens (the fetcher): every
    tenant's token replaced by its hash (``cluster.config.verifier``; with ``token``, that token's tenant only). A
    client file needs no token; a file naming etcd reads the map (which holds hashes) with ``token``, else the file's
    own."""
    if read_etcd_file(path) is None:
        return cluster_mod.load_verifier(path, token)
    return cluster_mod.verifier(load_client(path, token), token)


def _load(
    path: str | Path,
    etcd_endpoints: str | None,
    watch: bool,
    self_contained: Callable[[str | Path], ClusterConfig],
    pick_token: Callable[[str], str],
) -> ClusterConfig:
    """The file itself through ``self_contained``, or the map it names, presenting ``pick_token(the file's)``."""
    ref = read_etcd_file(path)
    if ref is None:
        if etcd_endpoints:
            raise ConfigError(f"{path} is a self-contained cluster file; it names no etcd map")
        return self_contained(path)
    endpoints, name, file_token = ref
    token = pick_token(file_token)
    try:
        etcd = Etcd(etcd_endpoints or endpoints)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        store = MapStore(etcd, name)
        if not watch:
            doc, revision = store.read()
            etcd.close()
            return _checked(doc, token, revision, None, Path(path))
        return MapFeed(store, token, Path(path)).latest()
    except EtcdUnavailable as exc:
        etcd.close()
        raise ConfigError(f"cannot read the cluster map: {exc}") from None
    except ConfigError:
        etcd.close()
        raise


def _checked(doc: Doc, token: str, revision: int, feed: MapFeed | None, path: Path | None) -> ClusterConfig:
    config = config_from_map(doc, token, revision, feed, path)
    if config.tenant_for_token(token) is None:
        raise ConfigError(f"the token in {path} is no token of cluster {config.name!r}")
    return config


# --- following the map ----------------------------------------------------------------------------------------


class MapFeed:
    """The newest map and the live members, kept current by a watch on the prefix (``ClusterConfig.feed``).

    Watch procedure (in the etcd thread): read everything under the prefix at revision R; watch from R + 1; apply
    every event in order (the map: adopt it if newer; ``members/``: the live set); after a stream error (the member
    died, lost its leader, the host was cut off) watch again, on the next member, from the last revision applied
    + 1, so no change is missed; if that revision was compacted away, read everything again. Every
    ``check_s`` (and at once after ``refresh``) the map key is read as well: a newer map than the one held is
    adopted even if the watch has not delivered it. While etcd is unreachable the last map stays in use.
    """

    def __init__(self, store: MapStore, token: str, path: Path | None = None, check_s: float = 2.0) -> None:
        self.store = store
        self.etcd = store.etcd
        self.token = token
        self.path = path
        self.check_s = check_s
        self.members: dict[int, Doc] = {}
        self.revisions_seen: list[int] = []  # every map revision adopted, in order
        self.listeners: list[Callable[[ClusterConfig], None]] = []  # called in the etcd thread on a new map
        self.member_listeners: list[Callable[[], None]] = []  # called in the etcd thread when members change
        self._wake: asyncio.Event | None = None
        doc, revision, applied = self.etcd.call(self._snapshot)
        self._config = _checked(doc, token, revision, self, path)
        self.doc = doc  # the map as stored (settings ClusterConfig does not carry: membership, hosts)
        self.revisions_seen.append(revision)
        self.etcd.spawn(self._watch(applied))
        self.etcd.spawn(self._check())

    def latest(self) -> ClusterConfig:
        return self._config

    def refresh(self, revision: int) -> None:
        if revision > self._config.revision and self._wake is not None:
            self.etcd.call_soon(self._wake.set)

    def close(self) -> None:
        self.etcd.close()

    async def _snapshot(self, client: aetcd.Client) -> tuple[Doc, int, int]:
        """Everything under the prefix: (map, its revision, the store revision it was read at)."""
        found = await client.get_prefix(self.store.prefix.encode())
        doc: Doc | None = None
        revision = 0
        members: dict[int, Doc] = {}
        for kv in found:
            if kv.key == self.store.map_key:
                doc, revision = _decode(kv.value), kv.mod_revision
            elif kv.key.decode().startswith(self.store.members):
                members[_member_id(kv.key)] = _member_info(kv.value)
        if doc is None:
            raise ConfigError(f"etcd at {self.etcd.where} holds no map for cluster {self.store.name!r}")
        self.members = members
        return doc, revision, found.header.revision

    def _adopt(self, doc: Doc, revision: int) -> None:
        if revision <= self._config.revision:
            return
        try:
            config = _checked(doc, self.token, revision, self, self.path)
        except ConfigError as exc:
            log.error("map revision %d is unusable, keeping revision %d: %s", revision, self._config.revision, exc)
            return
        self._config, self.doc = config, doc
        self.revisions_seen.append(revision)
        for listener in self.listeners:
            listener(config)

    def _apply(self, key: bytes, deleted: bool, value: bytes, mod_revision: int) -> None:
        if key == self.store.map_key:
            if not deleted:
                self._adopt(_decode(value), mod_revision)
            return
        if key.decode().startswith(self.store.members):
            nid = _member_id(key)
            if deleted:
                self.members.pop(nid, None)
            else:
                self.members[nid] = _member_info(value)
            for listener in self.member_listeners:
                listener()

    async def _watch(self, applied: int) -> None:
        """See the class docstring. ``applied``: the store revision everything up to which is applied."""
        while not self.etcd.closed:
            try:
                async for event in self.etcd.watch_prefix(self.store.prefix.encode(), applied + 1):
                    self._apply(event.key, event.deleted, event.value, event.mod_revision)
                    applied = max(applied, event.mod_revision)
            except Compacted:
                try:
                    doc, revision, applied = await self.etcd.run(self._snapshot, ATTEMPT_S * 2)
                    self._adopt(doc, revision)
                except (EtcdUnavailable, ConfigError) as exc:
                    log.warning("re-reading the cluster map failed: %s", exc)
            except asyncio.CancelledError:
                if stopping():
                    return
                await asyncio.sleep(0.2)  # a call of this task was cancelled under it (its channel closed): again
                continue
            except Exception as exc:  # the stream broke: watch again (on the next member, if this one failed)
                log.info("the watch of the cluster map broke (%s); watching again from revision %d", exc, applied + 1)
                await asyncio.sleep(0.2)

    async def _check(self) -> None:
        self._wake = asyncio.Event()

        async def check() -> None:
            got = await self.etcd.run(lambda c: c.get(self.store.map_key), self.check_s)
            if got is not None and got.mod_revision > self._config.revision:
                self._adopt(_decode(got.value), got.mod_revision)

        def failed(exc: Exception) -> None:
            log.info("cannot check the cluster map (keeping revision %d): %s", self._config.revision, exc)

        await self.etcd.repeat(check, lambda: self.check_s, self._wake, failed)


def _member_id(key: bytes) -> int:
    return int(key.rsplit(b"/", 1)[1])


def _member_info(raw: bytes) -> Doc:
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}
