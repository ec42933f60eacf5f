"""The cluster file: one TOML document describing nodes, placement groups, tenants, TTL classes and policy.

Loading validates everything and raises :class:`ConfigError` with one line saying what to fix. Relative
``data_dir`` paths are taken from the cluster file's folder, so a cluster directory can be moved whole.

**Secrets.** The cluster file holds every token: ``kvstore init`` writes it mode 0600, edits keep that mode, and
every process refuses to read a file holding tokens that group or others may open (``chmod 600 PATH``, one line).
Beside it, ``kvstore init`` writes the *client file* ``cluster.public.toml``: the same file with no tokens (no
``[cluster] token``, no ``[tenants]``: only the tokens' SHA-256 hashes, ``[cluster] token_hash`` for the admin's and
``tenant_hashes`` for the others', without their names), which may be world-readable and is kept in step by every
edit. A process that authenticates engines without holding their tokens (the fetcher) loads it with
:func:`load_verifier`. Clients
(engines, fetchers, kvbench, ``connect``) load either file with :func:`load_client` and present a tenant token from
``--token-file PATH`` (:func:`read_token_file`, mode 0600 checked), ``$KVTIER_TOKEN``, or else the file's own
cluster token; servers (nodes, the directory) load the cluster file with :func:`load`. Tokens are at least
:data:`MIN_TOKEN_CHARS` characters (128 bits or more; :func:`new_token` makes one) and tenant names are ASCII
(``[A-Za-z0-9_-]``).

Example (what ``kvstore init`` writes, abridged)::

    [cluster]
    name = "local"
    token = "…"                 # admin token; also the token of tenant "default"
    hash = "xxh3_128"

    [ttl]                       # TTL classes, seconds or "3d"/"12h"/"30s"
    agent = "3d"
    chatbot = "7d"

    [gc]
    high_watermark = 0.9
    low_watermark = 0.8

    [tenants.teamb]             # more tenants, each with its own token
    token = "…"
    quota = 0.25                # optional: its share of every primary's budget (tenants without one share the rest)

    [limits]                    # frames and connections (``protocol.Limits``): hello_timeout_s = "5s", …

    [[nodes]]
    id = 0
    host = "127.0.0.1"
    port = 7400
    data_dir = "node-0"
    capacity = "2GiB"
    metrics_port = 7412         # /metrics and /health, on metrics_host (default 127.0.0.1: loopback only)

    [[groups]]                  # placement groups of exactly 12 node slots
    nodes = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import re
import secrets
import socket
import stat
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
import tomlkit
import tomlkit.exceptions
import tomlkit.items

from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.keys import HASH_ALGOS
from kvtier.kvstore.units import format_duration, parse_duration, parse_size
from kvtier.kvstore.wire.protocol import MAX_BATCH, Limits

DEFAULT_TENANT = "default"
MAX_NODE_ID = 1 << 16  # node ids are 0 to 65,535 (the client sorts requests by id with a 16-bit radix sort)
TOKEN_ENV = "KVTIER_TOKEN"  # a client's tenant token, when not given on its command line
MIN_TOKEN_CHARS = 32  # 128 bits of hex; new_token() gives 64 hex characters (256 bits)
TOKEN_TENANT = "(token)"  # a client file's only tenant: the one its token names (no valid tenant name)
_TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOKEN_CHARS = re.compile(r"[!-~]+")  # printable ASCII, no spaces: tokens travel in files, env and HELLO
_TOKEN_HASH = re.compile(r"sha256:[0-9a-f]{64}")
DEFAULT_TTL_CLASSES = {"agent": 3 * 86400.0, "chatbot": 7 * 86400.0}
MAX_READ_LANES = 16


_T = TypeVar("_T")


class ConfigError(ValueError):
    """The cluster file is missing, malformed or inconsistent; the message says what to fix."""


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})  # a node at one of these runs on this machine
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with its NUL


@dataclass(frozen=True)
class NodeConfig:
    id: int
    host: str
    port: int
    data_dir: Path
    capacity_bytes: int
    metrics_port: int = 0  # 0: no HTTP metrics endpoint
    host_id: str = ""  # the failure domain (host) it runs on, as the etcd map names it ("": a cluster file's node)
    state: str = "up"  # membership, from the etcd map: "new" (never registered), "up" or "down"
    filling: bool = False  # replaced or new, being filled by repair: written to, not read from
    metrics_host: str = "127.0.0.1"  # where /metrics and /health listen: loopback unless the file says otherwise

    @property
    def local_socket(self) -> Path | None:
        """The Unix socket a node on this machine listens on beside its TCP port (``node.sock`` in its data dir),
        which clients on the same machine use instead: None for a node elsewhere, or where the path is too long for
        a Unix socket. Only the data dir's owner can create it, so no other user can stand in for the node there."""
        path = self.data_dir / "node.sock"
        local = self.host in LOCAL_HOSTS and len(os.fsencode(path)) <= MAX_UNIX_PATH
        return path if local else None


@dataclass(frozen=True)
class GCConfig:
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    interval_s: float = 5.0  # how often the worker looks at usage and expiry
    # a peer may stall mid-frame this long; shards that no block record names are orphans once this old
    write_timeout_s: float = 600.0
    # a write whose payload arrived and that is not committed this long after is settled (its writer died): the
    # primary says whether the block is live, else the shards are dropped, so uncommitted payload holds its slots
    # and its tenant's budget seconds, not the write timeout
    pending_timeout_s: float = 30.0
    # of a node's capacity, what one tenant's shards other than shard 0s may take before their block's primary has
    # confirmed the block (kvstore.node.unconfirmed): what shards sent without their shard 0 can strand, for
    # write_timeout_s
    unconfirmed_share: float = 0.1
    grace_s: float = 0.0  # a removed shard's slot is reused this long after no reply pins it (pins protect reads)
    room_wait_s: float = 2.0  # a write finding a node full waits this long for removals under way to free room
    access_flush_s: float = 2.0  # last-access times are written to disk in batches this often
    # metadata (LMDB) is flushed to disk this often; a killed process loses nothing either way, and the kernel
    # writes back dirty pages within 30 s anyway: each flush write-protects every page, and the next write to
    # one faults, so at capacity a flush every second cost a node ~10 % of its CPU
    meta_sync_s: float = 5.0
    repair_bytes_per_s: float = 64.0 * (1 << 20)  # background repair never moves more than this
    # every committed shard's crc32c is checked once per period, reading at most this fast (the scrubber)
    scrub_period_s: float = 7 * 86400.0
    scrub_bytes_per_s: float = 32.0 * (1 << 20)
    # a node's slab files take new room only while its filesystem keeps a headroom free for the metadata and the
    # logs (``kvstore.node.disk``): the share of its size past this fraction, but never more than max_headroom_bytes
    # (10 % of a large disk is far more than they need); beyond it a write is refused NO_SPACE
    max_disk_fraction: float = 0.9
    max_headroom_bytes: int = 1 << 30


@dataclass(frozen=True)
class ClientConfig:
    read_fanout: int = 10  # nodes asked per read (10: the data shards; parity only in a second round on a miss)
    min_write_shards: int = 11  # a put needs this many shards durable (and the primary's) to commit
    op_timeout_s: float = 10.0
    connect_timeout_s: float = 2.0
    retry_down_after_s: float = 1.0  # a node that refused a connection is not retried sooner
    # a large get_into is split into lanes, each a thread with its own connections, so a host with more cores
    # than the two here receives on several at once: 0 = one lane per two cores (one on a small host), at most 16
    read_lanes: int = 0
    read_lane_min_bytes: int = 32 << 20  # a lane carries at least this much, so small reads stay on one thread
    # a read still short of 10 shards this long after it was sent asks the holders not asked yet (parity) as well,
    # so a slow node or link costs at most this much (0: only once the first round has finished)
    hedge_after_s: float = 1.0


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    token: str  # the token this process presents: the admin's (cluster file), a tenant's (load_client), "" for none
    hash_algo: str
    nodes: dict[int, NodeConfig]
    groups: list[list[int]]
    tenants: dict[str, str]  # tenant name -> token; DEFAULT_TENANT has the cluster token (empty: a client file)
    ttl_classes: dict[str, float]
    quotas: dict[str, float] = field(default_factory=dict)  # tenant -> share of each primary's budget (0, 1]
    gc: GCConfig = field(default_factory=GCConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    limits: Limits = field(default_factory=Limits)
    path: Path | None = None
    revision: int = 0  # the etcd map's revision this config is (0: a cluster file)
    previous_groups: list[list[int]] = field(default_factory=list)  # the groups before a growth, while it moves
    feed: MapFeed | None = field(default=None, compare=False, repr=False)  # keeps an etcd map current

    def tenant_for_token(self, token: str) -> str | None:
        """The tenant a token authenticates, comparing against every tenant in constant time (an etcd map holds
        tokens' hashes, ``token_hash``, never the tokens)."""
        import hmac

        found = None
        hashed = token_hash(token)
        for name, expected in self.tenants.items():
            presented = hashed if expected.startswith(TOKEN_HASH_PREFIX) else token
            if hmac.compare_digest(expected.encode(), presented.encode()):
                found = name
        return found


class MapFeed(Protocol):
    """Where a config from the etcd map gets its successors (``kvstore.cluster.map.MapFeed``)."""

    def latest(self) -> ClusterConfig:
        """The newest map this process has seen (cheap: no request)."""
        ...

    def refresh(self, revision: int) -> None:
        """A node answered on ``revision``: read the map again soon if this process's is older (does not wait)."""
        ...


TOKEN_HASH_PREFIX = "sha256:"


def token_hash(token: str) -> str:
    """What the etcd map and the client file store for a token: its SHA-256, hex, prefixed. Publishing it is safe
    for the tokens kvtier makes (256 random bits, ``new_token``): nobody finds a token from its hash."""
    return TOKEN_HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def hashed_tenant(hashed: str) -> str:
    """The name a tenant known only by its token's hash goes by (a client file names no tenant): ``t-`` and the
    hash's first 12 hex digits."""
    return "t-" + hashed.removeprefix(TOKEN_HASH_PREFIX)[:12]


# --- the file's schema (msgspec checks types, required and unknown keys; parse() checks what types cannot) ---


class _Table(msgspec.Struct, forbid_unknown_fields=True):
    pass


class _ClusterTable(_Table):
    token: str | None = None  # None: a client file (no secrets)
    token_hash: str | None = None  # a client file: the admin token's hash (token_hash)
    tenant_hashes: list[str] = []  # a client file: the other tenants' tokens' hashes, without their names
    name: str = "kvtier"
    hash: str = "xxh3_128"


class _NodeEntry(_Table):
    id: int
    port: int
    data_dir: str
    capacity: int | str
    host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_host: str = NodeConfig.metrics_host


class _GroupEntry(_Table):
    nodes: list[int]


class _TenantTable(_Table):
    token: str
    quota: float | None = None


class _File(msgspec.Struct):  # other top-level tables are other programs' settings
    cluster: _ClusterTable
    nodes: list[_NodeEntry] = []
    groups: list[_GroupEntry] = []
    tenants: dict[str, Any] = {}  # name -> _TenantTable, converted one by one to name the tenant in errors
    ttl: dict[str, Any] | None = None  # None: DEFAULT_TTL_CLASSES
    gc: dict[str, Any] = {}
    client: dict[str, Any] = {}
    limits: dict[str, Any] = {}


def _convert(value: Any, kind: type[_T], where: str = "") -> _T:
    """``value`` as ``kind``; ConfigError naming the key (``nodes[3].port: expected `int`, got `str```)."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        message, _, path = str(exc).partition(" - at `$")
        path = where + path.rstrip("`")
        message = message[:1].lower() + message[1:]
        raise ConfigError(f"{path.lstrip('.')}: {message}" if path else message) from None


def _settings(kind: type[_T], table: dict[str, Any], section: str) -> _T:
    """A settings dataclass from its table; ``*_s`` keys may be durations (``"30s"``), ``*_bytes`` keys sizes
    (``"32MiB"``)."""
    unknown = set(table) - {f.name for f in fields(kind)}
    if unknown:
        raise ConfigError(f"[{section}] has unknown keys: {', '.join(sorted(unknown))}")
    values = {}
    for key, raw in table.items():
        try:
            if isinstance(raw, str) and key.endswith("_s"):
                raw = parse_duration(raw)
            elif isinstance(raw, str) and key.endswith("_bytes"):
                raw = parse_size(raw)
            values[key] = raw
        except ValueError as exc:
            raise ConfigError(f"{section}.{key}: {exc}") from None
    return _convert(values, kind, section)


def _read(path: Path) -> tuple[str, int]:
    """The file's text and permission bits (of the file read, a symlink's target)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), stat.S_IMODE(os.fstat(f.fileno()).st_mode)
    except FileNotFoundError:
        raise ConfigError(f"cluster file {path} does not exist (create one with `kvstore init DIR`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc}") from None


def check_private(path: Path, mode: int, what: str = "tokens") -> None:
    """ConfigError (one line, naming the fix) when a file holding ``what`` may be opened by group or others."""
    if mode & 0o077:
        raise ConfigError(f"{path} holds {what} but group/others may open it (mode {mode:04o}): run `chmod 600 {path}`")


def check_token(token: str, where: str) -> None:
    """ConfigError unless ``token`` is long enough to be unguessable and travels safely (printable ASCII)."""
    if len(token) < MIN_TOKEN_CHARS or not _TOKEN_CHARS.fullmatch(token):
        raise ConfigError(
            f"{where} must be at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces (128+ bits; "
            "`kvctl tenant add NAME` or `python3 -c 'import secrets; print(secrets.token_hex(32))'` makes one)"
        )


def check_tenant_name(name: str) -> None:
    """ConfigError unless ``name`` is 1 to 64 ASCII letters, digits, ``-`` and ``_`` (no look-alikes)."""
    if not _TENANT_NAME.fullmatch(name):
        raise ConfigError(f"tenant name {name!r} may only hold ASCII letters, digits, - and _ ([A-Za-z0-9_-], 1 to 64)")


def new_token() -> str:
    """A fresh token: 256 random bits from ``secrets``, as 64 hex characters."""
    return secrets.token_hex(32)


def load(path: str | Path) -> ClusterConfig:
    """Read and validate the cluster file (with its tokens: nodes, the directory, admin tools).

    Raises ConfigError (one line) on any problem, when the file holds tokens and group or others may open it, or
    when it is a client file (no tokens).
    """
    path = Path(path)
    config = _load(path)
    if not config.token:
        raise ConfigError(
            f"{path} holds no tokens (a client file): nodes and the directory need the cluster file itself"
        )
    return config


def load_client(path: str | Path, token: str | None = None) -> ClusterConfig:
    """The cluster (or client) file as a client uses it, with the token it presents in ``token``.

    The token is ``token`` if given, else ``$KVTIER_TOKEN``, else the file's own ``[cluster] token`` (the admin).
    From a client file (no tokens) the config's only tenant is :data:`TOKEN_TENANT`, authenticated by that token
    (what a fetcher serving one tenant accepts). Raises ConfigError as :func:`load` does, and when a client file
    comes with no token.
    """
    path = Path(path)
    config = _load(path)
    token = token or os.environ.get(TOKEN_ENV) or config.token
    if not token:
        raise ConfigError(
            f"{path} holds no tokens (a client file): give a tenant token with --token-file PATH or ${TOKEN_ENV}"
        )
    if token == config.token:
        return config
    return replace(config, token=token, tenants=config.tenants if config.token else {TOKEN_TENANT: token})


def load_verifier(path: str | Path, token: str | None = None) -> ClusterConfig:
    """The cluster or client file as a server uses it that authenticates tenants without holding their tokens (the
    fetcher): :func:`verifier` of it. Raises ConfigError as :func:`load` does."""
    return verifier(_load(Path(path)), token)


def verifier(config: ClusterConfig, token: str | None = None) -> ClusterConfig:
    """``config`` with every tenant's token replaced by its hash and no token of its own, so that the process keeps
    none (``tenant_for_token`` compares hashes); with ``token``, the tenant of that token only. Raises ConfigError
    (one line) when the file knows no tenant (a client file written before it kept the hashes) or ``token`` is none
    of its tenants'."""
    where = config.path or "the cluster file"
    tenants = {name: t if t.startswith(TOKEN_HASH_PREFIX) else token_hash(t) for name, t in config.tenants.items()}
    if token is not None:
        name = config.tenant_for_token(token) if tenants else TOKEN_TENANT
        if name is None:
            raise ConfigError(f"the token given is not one of the tenants' of {where}")
        tenants = {name: token_hash(token)}
    if not tenants:
        raise ConfigError(
            f"{where} knows no tenant's token or hash: write the client file again (`kvctl export-client`), or give "
            f"one tenant's token with --token-file PATH or ${TOKEN_ENV}"
        )
    return replace(config, token="", tenants=tenants)


def read_token_file(path: str | Path) -> str:
    """The token in a file of its own (``--token-file``: one line). Raises ConfigError (one line) when the file
    is missing, empty, or may be opened by group or others."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            text, mode = f.read(), stat.S_IMODE(os.fstat(f.fileno()).st_mode)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read token file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    check_private(path, mode, "a token")
    token = text.strip()
    if not token or "\n" in token:
        raise ConfigError(f"token file {path} must hold one token on one line")
    return token


def _load(path: Path) -> ClusterConfig:
    text, mode = _read(path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster file {path} is not valid TOML: {exc}") from None
    try:
        config = parse(doc, base_dir=path.parent.resolve(), path=path)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if config.token:
        check_private(path, mode)
    return config


def parse(doc: dict[str, Any], base_dir: Path, path: Path | None = None) -> ClusterConfig:
    """Validate a decoded cluster file (``data_dir`` paths are relative to ``base_dir``). Raises ConfigError."""
    file = _convert(doc, _File)
    cluster = file.cluster
    if cluster.token is not None:
        check_token(cluster.token, "cluster.token")
        if cluster.token_hash is not None or cluster.tenant_hashes:
            raise ConfigError("a cluster file holds tokens: token_hash and tenant_hashes belong in its client file")
    elif file.tenants:
        raise ConfigError("[tenants] without a [cluster] token: a client file holds no tokens at all")
    if cluster.hash not in HASH_ALGOS:
        raise ConfigError(f"cluster.hash must be one of {', '.join(HASH_ALGOS)}, got {cluster.hash!r}")

    if not file.nodes:
        raise ConfigError("the cluster file lists no [[nodes]]")
    nodes: dict[int, NodeConfig] = {}
    for entry in file.nodes:
        try:
            capacity = parse_size(entry.capacity)
        except ValueError as exc:
            raise ConfigError(f"node {entry.id}: capacity: {exc}") from None
        if not 0 <= entry.id < MAX_NODE_ID:
            raise ConfigError(f"node id {entry.id} is out of range: ids are 0 to {MAX_NODE_ID - 1}")
        if entry.id in nodes:
            raise ConfigError(f"node id {entry.id} is listed twice")
        if not 0 < entry.port < 65536 or not 0 <= entry.metrics_port < 65536:
            raise ConfigError(f"node {entry.id}: port {entry.port} or metrics_port {entry.metrics_port} out of range")
        if capacity <= 0:
            raise ConfigError(f"node {entry.id}: capacity must be positive")
        data_dir = (base_dir / entry.data_dir).resolve()
        nodes[entry.id] = NodeConfig(
            entry.id, entry.host, entry.port, data_dir, capacity, entry.metrics_port, entry.metrics_host
        )

    groups = []
    for n, group in enumerate(file.groups):
        if len(group.nodes) != TOTAL_SHARDS:
            raise ConfigError(f"groups[{n}] has {len(group.nodes)} nodes; each group has exactly {TOTAL_SHARDS}")
        missing = [m for m in group.nodes if m not in nodes]
        if missing:
            raise ConfigError(f"groups[{n}] names unknown node ids {missing}")
        groups.append(group.nodes)
    if not groups:
        raise ConfigError(f"the cluster file has no [[groups]] (each is {TOTAL_SHARDS} node slots)")

    tenants = {} if cluster.token is None else {DEFAULT_TENANT: cluster.token}
    for where, hashed in [
        ("cluster.token_hash", cluster.token_hash),
        *(("cluster.tenant_hashes", h) for h in cluster.tenant_hashes),
    ]:
        if hashed is not None and not _TOKEN_HASH.fullmatch(hashed):
            raise ConfigError(f"{where} must be a token's hash: sha256: and 64 lowercase hex digits")
    if cluster.token_hash is not None:
        tenants[DEFAULT_TENANT] = cluster.token_hash
    tenants.update((hashed_tenant(h), h) for h in cluster.tenant_hashes)
    quotas: dict[str, float] = {}
    for name, table in file.tenants.items():
        tenant = _convert(table, _TenantTable, f"tenants.{name}")
        if name == DEFAULT_TENANT:
            raise ConfigError(f"tenant {DEFAULT_TENANT!r} is implicit (it uses the cluster token)")
        check_tenant_name(name)
        check_token(tenant.token, f"tenants.{name}.token")
        if tenant.token in tenants.values():
            raise ConfigError(f"tenants.{name}.token is already used by another tenant")
        tenants[name] = tenant.token
        if tenant.quota is not None:
            if not 0 < tenant.quota <= 1:
                raise ConfigError(f"tenants.{name}.quota must be a share of the budget above 0 and at most 1")
            quotas[name] = tenant.quota
    if sum(quotas.values()) > 1 + 1e-9:
        raise ConfigError(f"the tenants' quotas add up to {sum(quotas.values()):g}; together they may not pass 1")

    ttl_table = DEFAULT_TTL_CLASSES if file.ttl is None else file.ttl
    if not ttl_table:
        raise ConfigError("[ttl] must define at least one TTL class")
    ttl_classes = {}
    for name, value in ttl_table.items():
        try:
            ttl_classes[name] = parse_duration(_convert(value, int | float | str, f"ttl.{name}"))
        except ValueError as exc:
            raise ConfigError(f"ttl.{name}: {exc}") from None

    gc = _settings(GCConfig, file.gc, "gc")
    if not 0 < gc.low_watermark < gc.high_watermark <= 1:
        raise ConfigError("[gc] watermarks need 0 < low_watermark < high_watermark <= 1")
    if not 0 < gc.unconfirmed_share <= 1 or not gc.pending_timeout_s > 0:
        raise ConfigError("[gc] unconfirmed_share must be above 0 and at most 1, pending_timeout_s positive")
    if not gc.meta_sync_s > 0 or not gc.access_flush_s > 0:
        raise ConfigError("[gc] meta_sync_s and access_flush_s must be positive")
    if not gc.scrub_period_s > 0 or not gc.scrub_bytes_per_s > 0 or not gc.repair_bytes_per_s > 0:
        raise ConfigError("[gc] scrub_period_s, scrub_bytes_per_s and repair_bytes_per_s must be positive")
    if not 0 < gc.max_disk_fraction <= 1:
        raise ConfigError("[gc] max_disk_fraction must be above 0 and at most 1")
    if not gc.max_headroom_bytes >= 0:
        raise ConfigError("[gc] max_headroom_bytes must be 0 or more")
    client = _settings(ClientConfig, file.client, "client")
    if not 10 <= client.read_fanout <= TOTAL_SHARDS:
        raise ConfigError(f"[client] read_fanout must be between 10 and {TOTAL_SHARDS}")
    if not 10 <= client.min_write_shards <= TOTAL_SHARDS:
        raise ConfigError(f"[client] min_write_shards must be between 10 and {TOTAL_SHARDS}")
    if not 0 <= client.read_lanes <= MAX_READ_LANES or client.read_lane_min_bytes < 1:
        raise ConfigError(f"[client] read_lanes must be 0 (auto) to {MAX_READ_LANES}, read_lane_min_bytes positive")
    limits = _limits(file.limits)

    return ClusterConfig(
        name=cluster.name,
        token=cluster.token or "",
        hash_algo=cluster.hash,
        nodes=nodes,
        groups=groups,
        tenants=tenants,
        ttl_classes=ttl_classes,
        quotas=quotas,
        gc=gc,
        client=client,
        limits=limits,
        path=path,
    )


def _limits(table: dict[str, Any]) -> Limits:
    """``[limits]``, checked: every limit positive, the pre-auth share within the connection limit (the
    defaults of the pre-auth limits shrink to fit a smaller ``max_connections`` the file sets)."""
    limits = _settings(Limits, table, "limits")
    for f in fields(Limits):
        if not getattr(limits, f.name) > 0 and f.name != "max_connections_per_tenant":  # (0: an equal share)
            raise ConfigError(f"limits.{f.name} must be positive")
    if limits.max_connections_per_tenant < 0:
        raise ConfigError("limits.max_connections_per_tenant must be 0 (an equal share) or positive")
    if "max_pre_auth_connections" not in table:
        limits = replace(limits, max_pre_auth_connections=min(limits.max_pre_auth_connections, limits.max_connections))
    if "max_pre_auth_per_peer" not in table:
        per_peer = min(limits.max_pre_auth_per_peer, limits.max_pre_auth_connections)
        limits = replace(limits, max_pre_auth_per_peer=per_peer)
    if limits.max_batch > MAX_BATCH:
        raise ConfigError(f"limits.max_batch cannot exceed {MAX_BATCH}")
    if limits.max_pre_auth_connections > limits.max_connections:
        raise ConfigError("limits.max_pre_auth_connections cannot exceed limits.max_connections")
    if limits.max_pre_auth_per_peer > limits.max_pre_auth_connections:
        raise ConfigError("limits.max_pre_auth_per_peer cannot exceed limits.max_pre_auth_connections")
    return limits


PORT_RANGE_ENV = "KVTIER_PORT_RANGE"  # LOW-HIGH: where free_ports looks (one range per process that picks ports)


def free_ports(count: int, host: str = "127.0.0.1", within: tuple[int, int] | None = None) -> list[int]:
    """Distinct ports free right now, below the kernel's ephemeral range (``ip_local_port_range``, 32768 and up by
    default), so that the outgoing connections of other processes cannot take one between this call and the nodes
    binding it; within ``$KVTIER_PORT_RANGE`` (``LOW-HIGH``, high excluded) where it is set, so that processes given
    ranges apart never pick a port another one of them was given (a node killed and started again binds its port
    again: another cluster's file written in between could have taken it); within ``within`` (low, high excluded)
    where given. ConfigError for a malformed range, or one with no ``count`` free ports."""
    lowest, highest = within or port_range(count)
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    tries = 64 * count
    try:
        while len(socks) < count:
            tries -= 1
            if not tries:
                raise ConfigError(f"no {count} free ports between {lowest} and {highest} ({PORT_RANGE_ENV})")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, rng.randrange(lowest, highest)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_range(count: int) -> tuple[int, int]:
    """``free_ports``' range: ``$KVTIER_PORT_RANGE``, else from 10000 (or lower, where the kernel's ephemeral range
    starts lower) up to the kernel's ephemeral range."""
    given = os.environ.get(PORT_RANGE_ENV)
    if given:
        low, _, high = given.partition("-")
        if not (low.isdigit() and high.isdigit() and int(low) >= 1024 and int(low) + count <= int(high) <= 65536):
            raise ConfigError(
                f"{PORT_RANGE_ENV}={given!r} is no port range with room for {count}: write LOW-HIGH, "
                "1024 <= LOW and LOW + ports <= HIGH <= 65536 (HIGH excluded)"
            )
        return int(low), int(high)
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        ephemeral = 32_768
    lowest = min(10_000, max(1_024, ephemeral // 2))
    return lowest, ephemeral if ephemeral - lowest > 4 * count else 65_536  # (no room below the kernel's range)


def _size_value(n: int) -> str | int:
    """``"2GiB"`` for a whole number of binary units, else the number of bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return n


def _table(**values: Any) -> tomlkit.items.Table:
    table = tomlkit.table()
    table.update(values)
    return table


def write_default(
    directory: str | Path,
    nodes: int = 12,
    capacity_bytes: int = 2 << 30,
    host: str = "127.0.0.1",
    base_port: int | None = None,
    metrics: bool = True,
) -> Path:
    """Write ``DIR/cluster.toml`` for ``nodes`` local nodes (a multiple of 12), mode 0600, and its client file
    ``DIR/cluster.public.toml`` (no tokens, mode 0644); return the cluster file's path.

    Raises ConfigError when the file exists already (it is never overwritten). Ports are ``base_port`` onwards,
    or free ones the kernel hands out (on ``host``) when it is None.
    """
    if nodes <= 0 or nodes % TOTAL_SHARDS:
        raise ConfigError(f"--nodes must be a positive multiple of {TOTAL_SHARDS}, got {nodes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "cluster.toml"
    count = 2 * nodes if metrics else nodes
    ports = free_ports(count, host) if base_port is None else list(range(base_port, base_port + count))
    doc = tomlkit.document()
    doc.add(tomlkit.comment("kvtier cluster file (written by `kvstore init`)"))
    doc["cluster"] = _table(name="local", token=new_token(), hash="xxh3_128")
    doc["ttl"] = _table(**{name: format_duration(s) for name, s in DEFAULT_TTL_CLASSES.items()})
    doc["gc"] = _table(high_watermark=GCConfig.high_watermark, low_watermark=GCConfig.low_watermark)
    node_tables = tomlkit.aot()
    for i in range(nodes):
        node = _table(id=i, host=host, port=ports[i], data_dir=f"node-{i}", capacity=_size_value(capacity_bytes))
        if metrics:
            node["metrics_port"] = ports[nodes + i]
        node_tables.append(node)
    doc["nodes"] = node_tables
    groups = tomlkit.aot()
    for g in range(nodes // TOTAL_SHARDS):
        groups.append(_table(nodes=list(range(g * TOTAL_SHARDS, (g + 1) * TOTAL_SHARDS))))
    doc["groups"] = groups
    text = tomlkit.dumps(doc)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it holds every token
    except FileExistsError:
        raise ConfigError(f"{target} already exists; remove it or choose another directory") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    write_public(target, text)
    return target


def public_path(path: str | Path) -> Path:
    """Where the client file of the cluster file at ``path`` lives: ``cluster.public.toml`` beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.public.toml")


def write_public(path: str | Path, text: str | None = None, out: str | Path | None = None) -> Path:
    """Write the client file of the cluster file at ``path`` (its text ``text``, read if None) to ``out`` (default
    :func:`public_path`), mode 0644, atomically: the same cluster with no ``[cluster] token`` and no ``[tenants]``, the
    tokens' hashes in their place (unnamed: a client learns of no other tenant's name).
    Raises ConfigError when the cluster file cannot be read or the client file written."""
    path = Path(path)
    if text is None:
        text, mode = _read(path)
        check_private(path, mode)
    doc = tomllib.loads(text)
    cluster = doc.get("cluster", {})
    token = cluster.pop("token", None)
    if token is not None:
        cluster["token_hash"] = token_hash(token)
    hashes = sorted(token_hash(t["token"]) for t in doc.pop("tenants", {}).values() if "token" in t)
    if hashes:
        cluster["tenant_hashes"] = hashes
    header = f"# kvtier client file: {path.name} without its tokens (kept in step by `kvctl`); give clients a\n"
    header += f"# tenant token with --token-file PATH or ${TOKEN_ENV}. Safe to share.\n"
    target = public_path(path) if out is None else Path(out)
    try:
        _write_atomic(target, header + tomlkit.dumps(doc), mode=0o644)
    except OSError as exc:
        raise ConfigError(f"cannot write the client file {target}: {exc.strerror or exc}") from None
    return target


@contextlib.contextmanager
def edit(path: str | Path) -> Iterator[tomlkit.TOMLDocument]:
    """Change the cluster file at ``path`` in place, keeping the user's comments, layout and order.

    Yields the file's document (tomlkit: a dict-like whose changed values keep their line and comment) under an
    exclusive lock on the file's folder, so that two editors never interleave. When the block ends normally the
    document must still load (else ConfigError, one line, and the file is unchanged); it then replaces the file
    atomically (a temporary file in the same folder, fsynced, renamed over it, permissions kept), and the client
    file beside it (:func:`public_path`), if there is one, is rewritten to match. An exception in the block leaves
    the file as it was. Raises ConfigError when the file cannot be read, parsed or replaced, or when group or
    others may open it (it holds the tokens).
    """
    path = Path(os.path.realpath(path))
    with _folder_lock(path.parent):
        text, mode = _read(path)
        check_private(path, mode)
        try:
            doc = tomlkit.parse(text)
        except tomlkit.exceptions.ParseError as exc:
            raise ConfigError(f"cluster file {path} is not valid TOML: {exc}") from None
        yield doc
        text = tomlkit.dumps(doc)
        try:
            parse(tomllib.loads(text), base_dir=path.parent, path=path)
        except (tomllib.TOMLDecodeError, ValueError) as exc:
            raise ConfigError(f"the change would break {path} ({exc}); it was not made") from None
        try:
            _write_atomic(path, text, mode)
        except OSError as exc:
            raise ConfigError(f"cannot rewrite {path}: {exc.strerror or exc}") from None
        if public_path(path).exists():
            write_public(path, text)


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError as exc:
        raise ConfigError(f"cannot open the cluster file's folder {folder}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
