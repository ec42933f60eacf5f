"""What every adapter shares: its settings, the keyspace that keeps deployments apart, and store calls that fail
soft.

An engine asks its external KV store from a hot path (a scheduler step, a prefetch thread, an event loop), so
an adapter's store calls promise what the engines' own backends promise:

- **A store that is down or slow is a miss.** :class:`AdapterStore` turns every failure of a call (nodes
  down, hung or refusing, a full cluster, a request the client refuses) into misses and failed writes,
  counted in ``stats`` and logged when the store's state changes, never into an exception.
- **Bounded.** A call first connects, at once, to every node it has no connection to, then makes at most four
  exchanges in sequence (a read: two rounds, then a repair's two phases, which follow only shards that nodes
  *answered* are lost; a look-up: the primaries' records, then the shards of blocks whose primary did not answer,
  asked only when some primary did; a write: a look-up, then two phases for the blocks whose primary answered).
  Connecting and each exchange get a fifth of ``timeout_s``, and a node that misses a deadline is skipped for
  its back-off (``kvstore.wire.transport``), so a call against a hung or partly hung store returns within
  ``timeout_s``.
- **Zero-copy.** Reads land in, and writes are sent from, the engine's own buffers (views, or raw pointers
  turned into views by :func:`pointer_views`); the caller must not touch them until the call returns.
- **Deployments never share pages by accident.** A :class:`Keyspace` is the digest of everything that makes two
  pages' bytes interchangeable (engine, model, dtype, layout, page geometry, tensor-parallel rank and size, an
  optional namespace); an engine's page key becomes a kvtier key *and* a header digest within it, so two
  deployments' keys differ, and a collision of kvtier keys is a counted miss, never another page's bytes.

Wrong settings are the one exception: :meth:`StoreSettings.from_mapping` and :class:`AdapterStore` raise
:class:`SettingsError` with one line saying what to fix, at start-up, before the engine serves.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.codec import DATA_SHARDS
from kvtier.kvstore.wire.transport import AuthError

log = logging.getLogger("kvtier.adapters")

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

KEY_BYTES = 16
DEFAULT_TIMEOUT_S = 5.0
SHARES_PER_CALL = 5  # connecting, then a read's two rounds and a repair's two phases


class SettingsError(ValueError):
    """An adapter's settings are wrong; the message says which and what to do."""


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """How an adapter reaches kvtier. Every engine passes these in its own configuration (see docs/adapters.md)."""

    config: Path  # the cluster file
    token: str | None = None  # the tenant's token (default: the cluster file's, tenant "default")
    ttl_class: str = "chatbot"  # the TTL class pages are written with
    timeout_s: float = DEFAULT_TIMEOUT_S  # about the longest one call waits on the store
    namespace: str = ""  # keeps deployments apart that would otherwise share pages (e.g. two fine-tunes)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str) -> StoreSettings:
        """Settings from an engine's configuration mapping (other keys in it are the engine's own and ignored).

        ``token_file`` (a file holding the token) may stand for ``token``, so that the token is not on a command
        line. Raises SettingsError naming ``where``, for ``kv_format`` too: adapters store the engine's pages as
        they are (docs/adapters.md, "KV formats"), and ignoring it would leave a deployment believing them encoded.
        """
        if "kv_format" in values:
            raise SettingsError(
                f"{where}: 'kv_format' is not an adapter setting: pages are stored in the engine's own KV dtype; "
                "choose it there (vLLM and SGLang: --kv-cache-dtype)"
            )
        path = values.get("config")
        if not isinstance(path, str | Path) or not str(path):
            raise SettingsError(f"{where}: 'config' must name kvtier's cluster file (e.g. /srv/kvtier/cluster.toml)")
        token = values.get("token")
        token_file = values.get("token_file")
        if token is not None and token_file is not None:
            raise SettingsError(f"{where}: give 'token' or 'token_file', not both")
        if token_file is not None:
            try:
                token = cluster_mod.read_token_file(token_file)  # its own file, mode 0600
            except cluster_mod.ConfigError as exc:
                raise SettingsError(f"{where}: {exc}") from None
        if token is not None and (not isinstance(token, str) or not token):
            raise SettingsError(f"{where}: 'token' must be a non-empty string")
        ttl_class = values.get("ttl_class", cls.ttl_class)
        if not isinstance(ttl_class, str) or not ttl_class:
            raise SettingsError(f"{where}: 'ttl_class' must name one of the cluster's TTL classes")
        timeout = values.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
            raise SettingsError(f"{where}: 'timeout_s' must be a number of seconds in (0, 3600], got {timeout!r}")
        namespace = values.get("namespace", "")
        if not isinstance(namespace, str):
            raise SettingsError(f"{where}: 'namespace' must be a string")
        return cls(Path(path), token, ttl_class, float(timeout), namespace)


class Keyspace:
    """Maps an engine's page keys onto kvtier keys and header digests, within one deployment's identity.

    ``identity`` is everything that makes two pages' bytes interchangeable; its canonical JSON digest keys a
    blake2b of (page key, piece), whose first half is the kvtier key and second half the header digest that
    the nodes store and a reader's call compares.
    """

    def __init__(self, identity: Mapping[str, Any]) -> None:
        self.identity = dict(identity)
        canonical = json.dumps(self.identity, sort_keys=True, separators=(",", ":"), default=str)
        self.digest = hashlib.sha256(canonical.encode()).digest()

    def keys(self, page_keys: Sequence[bytes | str], pieces: Sequence[int] = (0,)) -> tuple[list[bytes], list[bytes]]:
        """kvtier keys and header digests of the given pieces of every page, page-major (page 0's pieces first)."""
        keys: list[bytes] = []
        headers: list[bytes] = []
        for page_key in page_keys:
            raw = page_key.encode() if isinstance(page_key, str) else bytes(page_key)
            for piece in pieces:
                digest = hashlib.blake2b(raw + piece.to_bytes(4, "little"), key=self.digest, digest_size=32).digest()
                keys.append(digest[:KEY_BYTES])
                headers.append(digest[KEY_BYTES:])
        return keys, headers


def _readable(client: Client, live: np.ndarray, keys: Sequence[bytes]) -> np.ndarray:
    """Per key whether a read would find it, from its primary's answer (``liveness``: 1, 0, -1 unreachable).

    A key whose primary cannot be reached is readable if at least 10 of its shards are committed on nodes that
    answer (a read decodes around the primary). When no primary answered at all the store is down or hung, and
    nothing more is asked of it.
    """
    readable = live == 1
    unknown = np.flatnonzero(live < 0)
    if len(unknown) and len(unknown) < len(keys):
        shards = client.probe([keys[i] for i in unknown.tolist()])
        readable[unknown] = shards.sum(axis=1) >= DATA_SHARDS
    return readable


def pointer_views(pointers: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    """Writable byte views of raw memory (the engine's page buffers), without copying; valid while it is."""
    if len(pointers) != len(sizes):
        raise ValueError(f"{len(pointers)} pointers but {len(sizes)} sizes")
    return [
        memoryview((ctypes.c_char * int(n)).from_address(int(p))).cast("B")
        for p, n in zip(pointers, sizes, strict=True)
    ]


class AdapterStore:
    """kvtier calls for an adapter: a client per thread, failures contained (see the module docstring)."""

    def __init__(self, settings: StoreSettings, what: str) -> None:
        self.settings = settings
        self.what = what
        try:
            config = cluster_map.load_client(settings.config, settings.token)
        except cluster_mod.ConfigError as exc:
            raise SettingsError(f"{what}: {exc}") from None
        if settings.ttl_class not in config.ttl_classes:
            known = ", ".join(sorted(config.ttl_classes))
            raise SettingsError(f"{what}: the cluster has no TTL class {settings.ttl_class!r} (it has {known})")
        share = settings.timeout_s / SHARES_PER_CALL
        client = dataclasses.replace(
            config.client,
            op_timeout_s=share,
            connect_timeout_s=min(config.client.connect_timeout_s, share),
        )
        self.config = dataclasses.replace(config, client=client)
        self.stats = {"calls": 0, "failed_calls": 0, "hits": 0, "misses": 0, "stored": 0, "not_stored": 0}
        self._local = threading.local()
        self._clients: list[Client] = []
        self._lock = threading.Lock()
        self._failing = False
        self._probe()

    def _probe(self) -> None:
        """Refuse a wrong token at start-up, while someone is watching; a store that is down is only logged."""
        try:
            client = self.client()
            client.pool.connect()
            client.exists([bytes(KEY_BYTES)])
        except AuthError as exc:
            raise SettingsError(f"{self.what}: kvtier refused the token ({exc})") from None
        except Exception as exc:
            log.warning("%s: kvtier is not reachable yet (%s); its pages are misses until it is", self.what, exc)

    def client(self) -> Client:
        """This thread's client (a kvtier client is used by one thread at a time)."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = Client(self.config, token=self.settings.token)
            with self._lock:
                self._clients.append(client)
            self._local.client = client
        return client

    def _call(self, op: str, fn: Callable[[Client], T], fallback: T) -> T:
        """``fn(client)``, or ``fallback`` if it raised: the store failing is never the engine's exception."""
        try:
            client = self.client()
            client.pool.connect()  # every node not connected yet, at once: one connection timeout at most
            result = fn(client)
        except Exception as exc:  # the contract: any failure of the store is a miss
            self._count(calls=1, failed_calls=1)
            if not self._failing:
                self._failing = True
                log.warning(
                    "%s: kvtier %s failed (%s: %s); misses until it answers", self.what, op, type(exc).__name__, exc
                )
            return fallback
        self._count(calls=1)
        if self._failing:
            self._failing = False
            log.warning("%s: kvtier answers again", self.what)
        return result

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.stats[name] += delta

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored (metadata only); 0 if the store fails."""
        if not keys:
            return 0
        stored = self.exists(keys)
        return stored.index(False) if False in stored else len(stored)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key whether it is stored and readable (metadata only); all False if the store fails."""
        if not keys:
            return []
        return self._call("exists", lambda c: _readable(c, c.liveness(keys), keys).tolist(), [False] * len(keys))

    def get_into(self, keys: Sequence[bytes], headers: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        """Read each block into its buffer (exactly the block's length); per key whether it was read."""
        if not keys:
            return []
        found = self._call("get", lambda c: c.get_into(keys, buffers, headers=headers), [False] * len(keys))
        self._count(hits=sum(found), misses=len(found) - sum(found))
        return found

    def get(self, keys: Sequence[bytes], headers: Sequence[bytes]) -> list[bytearray | None]:
        """Read whole blocks of unknown length into new buffers; None for a miss."""
        if not keys:
            return []
        return self._call("get", lambda c: c.get(keys, headers=headers), [None] * len(keys))

    def put(self, keys: Sequence[bytes], headers: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        """Store blocks not stored yet (one metadata probe first, so pages already there are not sent again);
        per key whether it is stored now."""
        if not keys:
            return []

        def put_missing(client: Client) -> list[bool]:
            live = client.liveness(keys)
            stored = _readable(client, live, keys).tolist()
            todo = np.flatnonzero(live == 0).tolist()  # a block whose primary does not answer cannot commit
            if todo:
                done = client.put_from(
                    [keys[i] for i in todo],
                    [buffers[i] for i in todo],
                    self.settings.ttl_class,
                    headers=[headers[i] for i in todo],
                )
                for i, ok in zip(todo, done, strict=True):
                    stored[i] = ok
            return stored

        stored = self._call("put", put_missing, [False] * len(keys))
        self._count(stored=sum(stored), not_stored=len(stored) - sum(stored))
        return stored

    def delete(self, keys: Sequence[bytes]) -> bool:
        """Remove blocks; whether every node concerned answered."""
        if not keys:
            return True
        return self._call("delete", lambda c: c.delete(keys), False)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
