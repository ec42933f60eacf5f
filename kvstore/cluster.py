"""The cluster file: one TOML document describing nodes, placement groups, tenants, TTL classes and policy.

Loading validates everything and raises :class:`ConfigError` with one line saying what to fix. Relative
``data_dir`` paths are taken from the cluster file's folder, so a cluster directory can be moved whole.

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

    [[nodes]]
    id = 0
    host = "127.0.0.1"
    port = 7400
    data_dir = "node-0"
    capacity = "2GiB"

    [[groups]]                  # placement groups of exactly 12 node slots
    nodes = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import secrets
import socket
import stat
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import tomlkit
import tomlkit.exceptions
import tomlkit.items

from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.keys import HASH_ALGOS
from kvtier.kvstore.protocol import Limits
from kvtier.kvstore.units import format_duration, parse_duration, parse_size

DEFAULT_TENANT = "default"
DEFAULT_TTL_CLASSES = {"agent": 3 * 86400.0, "chatbot": 7 * 86400.0}


_T = TypeVar("_T")


class ConfigError(ValueError):
    """The cluster file is missing, malformed or inconsistent; the message says what to fix."""


@dataclass(frozen=True)
class NodeConfig:
    id: int
    host: str
    port: int
    data_dir: Path
    capacity_bytes: int
    metrics_port: int = 0  # 0: no HTTP metrics endpoint


@dataclass(frozen=True)
class GCConfig:
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    interval_s: float = 5.0  # how often the worker looks at usage and expiry
    write_timeout_s: float = 600.0  # a shard pending longer than this belongs to a dead writer
    grace_s: float = 0.0  # a removed shard's slot is reused this long after no reply pins it (pins protect reads)
    room_wait_s: float = 2.0  # a write finding a node full waits this long for removals under way to free room
    access_flush_s: float = 2.0  # last-access times are written to disk in batches this often
    # metadata (LMDB) is flushed to disk this often; a killed process loses nothing either way, and the kernel
    # writes back dirty pages within 30 s anyway: each flush write-protects every page, and the next write to
    # one faults, so at capacity a flush every second cost a node ~10 % of its CPU
    meta_sync_s: float = 5.0
    repair_bytes_per_s: float = 64.0 * (1 << 20)  # background repair never moves more than this


@dataclass(frozen=True)
class ClientConfig:
    read_fanout: int = 10  # nodes asked per read (10: the data shards; parity only in a second round on a miss)
    min_write_shards: int = 11  # a put needs this many shards durable (and the primary's) to commit
    op_timeout_s: float = 10.0
    connect_timeout_s: float = 2.0
    retry_down_after_s: float = 1.0  # a node that refused a connection is not retried sooner


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    token: str
    hash_algo: str
    nodes: dict[int, NodeConfig]
    groups: list[list[int]]
    tenants: dict[str, str]  # tenant name -> token; DEFAULT_TENANT has the cluster token
    ttl_classes: dict[str, float]
    gc: GCConfig = field(default_factory=GCConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    limits: Limits = field(default_factory=Limits)
    path: Path | None = None

    def tenant_for_token(self, token: str) -> str | None:
        """The tenant a token authenticates, comparing against every tenant in constant time."""
        import hmac

        found = None
        for name, expected in self.tenants.items():
            if hmac.compare_digest(expected.encode(), token.encode()):
                found = name
        return found


# --- the file's schema (msgspec checks types, required and unknown keys; parse() checks what types cannot) ---


class _Table(msgspec.Struct, forbid_unknown_fields=True):
    pass


class _ClusterTable(_Table):
    token: str
    name: str = "kvtier"
    hash: str = "xxh3_128"


class _NodeEntry(_Table):
    id: int
    port: int
    data_dir: str
    capacity: int | str
    host: str = "127.0.0.1"
    metrics_port: int = 0


class _GroupEntry(_Table):
    nodes: list[int]


class _TenantTable(_Table):
    token: str


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
    """A settings dataclass from its table; ``*_s`` keys may be durations (``"30s"``)."""
    unknown = set(table) - {f.name for f in fields(kind)}
    if unknown:
        raise ConfigError(f"[{section}] has unknown keys: {', '.join(sorted(unknown))}")
    values = {}
    for key, raw in table.items():
        try:
            values[key] = parse_duration(raw) if key.endswith("_s") and isinstance(raw, str) else raw
        except ValueError as exc:
            raise ConfigError(f"{section}.{key}: {exc}") from None
    return _convert(values, kind, section)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"cluster file {path} does not exist (create one with `kvstore init DIR`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc}") from None


def load(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file. Raises ConfigError (one line) on any problem."""
    path = Path(path)
    try:
        doc = tomllib.loads(_read(path))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster file {path} is not valid TOML: {exc}") from None
    try:
        return parse(doc, base_dir=path.parent.resolve(), path=path)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse(doc: dict[str, Any], base_dir: Path, path: Path | None = None) -> ClusterConfig:
    """Validate a decoded cluster file (``data_dir`` paths are relative to ``base_dir``). Raises ConfigError."""
    file = _convert(doc, _File)
    cluster = file.cluster
    if len(cluster.token) < 16:
        raise ConfigError("cluster.token must be at least 16 characters")
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
        if entry.id in nodes:
            raise ConfigError(f"node id {entry.id} is listed twice")
        if not 0 < entry.port < 65536 or not 0 <= entry.metrics_port < 65536:
            raise ConfigError(f"node {entry.id}: port {entry.port} or metrics_port {entry.metrics_port} out of range")
        if capacity <= 0:
            raise ConfigError(f"node {entry.id}: capacity must be positive")
        data_dir = (base_dir / entry.data_dir).resolve()
        nodes[entry.id] = NodeConfig(entry.id, entry.host, entry.port, data_dir, capacity, entry.metrics_port)

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

    tenants = {DEFAULT_TENANT: cluster.token}
    for name, table in file.tenants.items():
        tenant = _convert(table, _TenantTable, f"tenants.{name}")
        if name == DEFAULT_TENANT:
            raise ConfigError(f"tenant {DEFAULT_TENANT!r} is implicit (it uses the cluster token)")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"tenant name {name!r} may only hold letters, digits, - and _")
        if len(tenant.token) < 16:
            raise ConfigError(f"tenants.{name}.token must be at least 16 characters")
        if tenant.token in tenants.values():
            raise ConfigError(f"tenants.{name}.token is already used by another tenant")
        tenants[name] = tenant.token

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
    if not gc.meta_sync_s > 0 or not gc.access_flush_s > 0:
        raise ConfigError("[gc] meta_sync_s and access_flush_s must be positive")
    client = _settings(ClientConfig, file.client, "client")
    if not 10 <= client.read_fanout <= TOTAL_SHARDS:
        raise ConfigError(f"[client] read_fanout must be between 10 and {TOTAL_SHARDS}")
    if not 10 <= client.min_write_shards <= TOTAL_SHARDS:
        raise ConfigError(f"[client] min_write_shards must be between 10 and {TOTAL_SHARDS}")
    limits = _settings(Limits, file.limits, "limits")

    return ClusterConfig(
        name=cluster.name,
        token=cluster.token,
        hash_algo=cluster.hash,
        nodes=nodes,
        groups=groups,
        tenants=tenants,
        ttl_classes=ttl_classes,
        gc=gc,
        client=client,
        limits=limits,
        path=path,
    )


def _free_ports(count: int, host: str) -> list[int]:
    """Distinct ports free right now, below the kernel's ephemeral range (32768 and up), so that the outgoing
    connections of other processes cannot take one between this call and the nodes binding it."""
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        while len(socks) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, rng.randrange(10_000, 32_768)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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
    """Write ``DIR/cluster.toml`` for ``nodes`` local nodes (a multiple of 12) and return its path.

    Raises ConfigError when the file exists already (it is never overwritten). Ports are ``base_port`` onwards,
    or free ones the kernel hands out (on ``host``) when it is None.
    """
    if nodes <= 0 or nodes % TOTAL_SHARDS:
        raise ConfigError(f"--nodes must be a positive multiple of {TOTAL_SHARDS}, got {nodes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "cluster.toml"
    count = 2 * nodes if metrics else nodes
    ports = _free_ports(count, host) if base_port is None else list(range(base_port, base_port + count))
    doc = tomlkit.document()
    doc.add(tomlkit.comment("kvtier cluster file (written by `kvstore init`)"))
    doc["cluster"] = _table(name="local", token=secrets.token_hex(24), hash="xxh3_128")
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
    try:
        with open(target, "x") as f:
            f.write(tomlkit.dumps(doc))
    except FileExistsError:
        raise ConfigError(f"{target} already exists; remove it or choose another directory") from None
    return target


@contextlib.contextmanager
def edit(path: str | Path) -> Iterator[tomlkit.TOMLDocument]:
    """Change the cluster file at ``path`` in place, keeping the user's comments, layout and order.

    Yields the file's document (tomlkit: a dict-like whose changed values keep their line and comment) under an
    exclusive lock on the file's folder, so that two editors never interleave. When the block ends normally the
    document must still load (else ConfigError, one line, and the file is unchanged); it then replaces the file
    atomically (a temporary file in the same folder, fsynced, renamed over it, permissions kept). An exception in
    the block leaves the file as it was. Raises ConfigError when the file cannot be read, parsed or replaced.
    """
    path = Path(os.path.realpath(path))
    with _folder_lock(path.parent):
        try:
            doc = tomlkit.parse(_read(path))
        except tomlkit.exceptions.ParseError as exc:
            raise ConfigError(f"cluster file {path} is not valid TOML: {exc}") from None
        yield doc
        text = tomlkit.dumps(doc)
        try:
            parse(tomllib.loads(text), base_dir=path.parent, path=path)
        except (tomllib.TOMLDecodeError, ValueError) as exc:
            raise ConfigError(f"the change would break {path} ({exc}); it was not made") from None
        try:
            _write_atomic(path, text)
        except OSError as exc:
            raise ConfigError(f"cannot rewrite {path}: {exc.strerror or exc}") from None


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


def _write_atomic(path: Path, text: str) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
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
