"""The typed metadata of every request a storage node takes (:class:`~kvtier.kvstore.wire.protocol.Schemas`).

Each op's fields and their msgpack types, as the client sends them (``kvstore.wire.fields`` says what the ``bin``
columns hold). Decoding against them is the node's first check: a field of another type, or one the op does
not have, is ``BAD_REQUEST`` before any handler runs, and nothing the op does not declare is ever built (a
megabyte of nested empty arrays costs one type check, not a million Python lists). Every field is optional here;
the handlers say which they need (``fields.field``) and check lengths and ranges.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvtier.kvstore.wire.protocol import MAX_BATCH, UNSET, Hello, Op, Request, Schemas, Unset

MAX_TTL_CLASSES = 1024  # an ADMIN ttl_set names at most this many classes
MAX_PARENT_BYTES = 255
PAGE_BLOCKS = 32768  # blocks per page: ~1 MiB of metadata with 16-byte keys


class _Request(Request):
    tenant: str | Unset = UNSET  # the admin acting for a tenant (GC, repair)


class _Keys(_Request):
    keys: bytes | Unset = UNSET
    klen: int | Unset = UNSET


class _Shards(_Keys):
    idx: bytes | Unset = UNSET
    hdr: bytes | Unset = UNSET


class PutShards(_Shards):
    lens: bytes | Unset = UNSET
    blen: bytes | Unset = UNSET
    cls: str | Unset = UNSET
    put: bytes | Unset = UNSET
    ns: bytes | Unset = UNSET
    # one per shard 0, 1 or 2: bounded as it is decoded (the handler checks the count against the shards)
    par: (
        Annotated[list[Annotated[bytes, msgspec.Meta(max_length=MAX_PARENT_BYTES)]], msgspec.Meta(max_length=MAX_BATCH)]
        | Unset
    ) = UNSET
    created: bytes | Unset = UNSET
    replace: bool | Unset = UNSET


class Commit(_Request):
    put: bytes | Unset = UNSET
    act: bytes | Unset = UNSET
    miss: bytes | Unset = UNSET  # <u2 per shard: the shards of its block the writer could not store


class Owe(_Keys):
    miss: bytes | Unset = UNSET  # <u2 per key: the shards of its block that did not commit


class GetShards(_Shards):
    probe: bool | Unset = UNSET
    client_crc: bool | Unset = UNSET


class Match(_Keys):
    pass


class Delete(_Keys):
    idx: bytes | Unset = UNSET
    before: float | Unset = UNSET


class Stat(_Request):
    key: bytes | Unset = UNSET


class NodeInfo(_Request):
    pass


class Admin(_Request):
    action: str | Unset = UNSET
    on: bool | Unset = UNSET  # drain
    ttl_class: str | Unset = UNSET  # evict
    older_than_s: float | Unset = UNSET
    dry_run: bool | Unset = UNSET
    classes: Annotated[dict[str, float], msgspec.Meta(max_length=MAX_TTL_CLASSES)] | Unset = UNSET  # ttl_set
    repair: bool | Unset = UNSET  # gc
    rebuild: bool | Unset = UNSET
    node: int | Unset = UNSET  # blocks_held
    start: int | Unset = UNSET
    limit: int | Unset = UNSET
    before: float | Unset = UNSET


NODE_REQUESTS = Schemas(
    {
        Op.HELLO: Hello,
        Op.PUT_SHARDS: PutShards,
        Op.COMMIT: Commit,
        Op.GET_SHARDS: GetShards,
        Op.MATCH: Match,
        Op.DELETE: Delete,
        Op.STAT: Stat,
        Op.NODE_INFO: NodeInfo,
        Op.ADMIN: Admin,
        Op.OWE: Owe,
    }
)
