"""The kvtier client: batched, erasure-coded block reads and writes against a cluster.

Promises, for every method:

- **Batched.** One call sends at most one request per node per phase, whatever the number of keys.
- **Misses are not errors.** A block that is absent, expired, evicted, unreadable (fewer than 10 good
  shards) or whose header does not match the caller's tokens is a miss: ``None`` / ``False`` /
  a shorter ``match``. Exceptions mean a caller error (bad arguments, unknown TTL class), a wrong token
  (:class:`~kvtier.kvstore.wire.transport.AuthError`) or a full cluster (:class:`CapacityError`).
- **Never wrong bytes.** Each shard is checked against the crc32c its node stored as it lands (end to end,
  counted in ``stats["corrupt_shards"]``); a read decodes around up to two lost or corrupt shards and is a
  miss beyond that.
- **Zero-copy.** ``get_into`` receives each node's shards straight into the caller's buffers;
  ``put_from`` sends shards as views of the caller's buffers. The caller must not modify buffers while a
  call runs; once it returns, kvtier holds no reference to them.
- **Two-phase writes.** Shards are written PENDING on every node of the block's group, then COMMITTED;
  the block becomes visible when its primary records it. A writer that dies mid-put leaves only pending
  shards, which no reader is ever given and GC reclaims.

Collision safety: pass ``tokens=`` (the token array the keys were chained from) and ``namespace=`` (or
connect with a default namespace) to ``put``/``get``: the block's header digest is stored and checked, and
a mismatch is a miss counted in ``stats["header_mismatches"]``. ``headers=`` passes precomputed digests
(:func:`~kvtier.kvstore.keys.header_digests`) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.kvstore.client.core import Buffer
from kvtier.kvstore.client.lookups import Lookups
from kvtier.kvstore.client.repair import Repairs
from kvtier.kvstore.client.writes import CapacityError
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster import map as cluster_map
from kvtier.kvstore.keys import Namespace

__all__ = ["AsyncClient", "CapacityError", "Client", "connect", "connect_async"]


class Client(Lookups, Repairs):
    """Synchronous client. Not thread-safe: use one per thread, or :class:`AsyncClient`."""


def connect(path: str | Path, token: str | None = None, namespace: Namespace | None = None) -> Client:
    """A client for the cluster described by the cluster file at ``path`` (use it as a context manager); a file that
    names etcd gives the map there, followed as it changes.

    ``path`` may be the cluster file or its token-free client file (``cluster.public.toml``). ``token`` selects
    the tenant (default: ``$KVTIER_TOKEN``, else the file's cluster token, tenant "default";
    :func:`~kvtier.kvstore.cluster.config.load_client`).
    """
    return Client(cluster_map.load_client(path, token), namespace=namespace)


class AsyncClient:
    """The same API for asyncio code: each call runs a pooled synchronous client in a worker thread.

    The data path releases the GIL in socket calls and in the codec, so concurrent calls overlap.
    Cancelling a call waits for its thread to finish before the cancellation propagates: once the
    awaiting coroutine is cancelled, nothing writes into its buffers any more, and a client returns to
    the pool only when it is idle.
    """

    def __init__(self, config: cluster_mod.ClusterConfig, token: str | None = None, namespace: Namespace | None = None):
        self._factory = lambda: Client(config, token=token, namespace=namespace)
        self._idle: list[Client] = []
        self._all: list[Client] = []

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        client = self._idle.pop() if self._idle else None
        if client is None:
            client = self._factory()
            self._all.append(client)
        call = functools.partial(getattr(client, name), *args, **kwargs)
        running = asyncio.ensure_future(asyncio.to_thread(call))
        running.add_done_callback(lambda _: self._idle.append(client))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await running  # the thread cannot be stopped: let it finish before we give up its buffers
            raise

    async def put(
        self, keys: Sequence[bytes], blocks: Sequence[Buffer], ttl_class: str = "chatbot", **kw: Any
    ) -> list[bool]:
        return await self._call("put", keys, blocks, ttl_class, **kw)

    async def put_from(
        self, keys: Sequence[bytes], buffers: Sequence[Buffer], ttl_class: str = "chatbot", **kw: Any
    ) -> list[bool]:
        return await self._call("put_from", keys, buffers, ttl_class, **kw)

    async def get(self, keys: Sequence[bytes], **kw: Any) -> list[bytearray | None]:
        return await self._call("get", keys, **kw)

    async def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer], **kw: Any) -> list[bool]:
        return await self._call("get_into", keys, buffers, **kw)

    async def match(self, keys: Sequence[bytes]) -> int:
        return await self._call("match", keys)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._call("exists", keys)

    async def delete(self, keys: Sequence[bytes], before: float | None = None) -> bool:
        return await self._call("delete", keys, before)

    async def stat(self, key: bytes) -> dict[str, Any]:
        return await self._call("stat", key)

    async def close(self) -> None:
        for client in self._all:
            client.close()
        self._all.clear()
        self._idle.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect_async(path: str | Path, token: str | None = None, namespace: Namespace | None = None) -> AsyncClient:
    """:func:`connect` for asyncio code."""
    return AsyncClient(cluster_map.load_client(path, token), namespace=namespace)
