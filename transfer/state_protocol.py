"""StateBlock messages, sans-IO: the directory's requests and the host-to-host pull. No sockets here.

Frames are the store's (:mod:`kvtier.kvstore.wire.protocol`); every connection starts with HELLO + token.

Directory (``kvtier-directory``), all batched::

    REGISTER   host, addr [ip, port], keys, klen, slot u32[n], gen u64[n], full   → known
               full=True replaces everything the directory holds for that host (a re-report);
               known=False: full=False from a host it does not know, dropped (re-report with full=True)
    UNREGISTER host, keys, klen, slot u32[n], gen u64[n]                          → {}
    HEARTBEAT  host                                                               → known (False: re-report)
    LOOKUP     keys, klen                                                         → host i16[n] (-1: none),
               addrs [[ip, port], ...] (indexed by host), slot u32[n], gen u64[n]
    STATS                                                                         → hosts, entries

Pull (each host's StateBlock server)::

    PULL       key, slot, gen    → found, length; then ``length`` payload bytes (the slot's), or none
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from kvtier.kvstore.wire import fields as wire
from kvtier.kvstore.wire.protocol import UNSET, Hello, Op, Request, Schemas, Unset


class StateOp(enum.IntEnum):
    HELLO = Op.HELLO
    REGISTER = 48
    UNREGISTER = 49
    HEARTBEAT = 50
    LOOKUP = 51
    STATS = 52
    PULL = 56


class _Keys(Request):
    keys: bytes | Unset = UNSET
    klen: int | Unset = UNSET


class _Entries(_Keys):
    host: str | Unset = UNSET
    slot: bytes | Unset = UNSET
    gen: bytes | Unset = UNSET


class Register(_Entries):
    addr: Annotated[list[str | int], msgspec.Meta(max_length=2)] | Unset = UNSET
    full: bool | Unset = UNSET


class Heartbeat(Request):
    host: str | Unset = UNSET


class Stats(Request):
    pass


class Pull(Request):
    key: bytes | Unset = UNSET
    slot: int | Unset = UNSET
    gen: int | Unset = UNSET


DIRECTORY_REQUESTS = Schemas(
    {
        StateOp.HELLO: Hello,
        StateOp.REGISTER: Register,
        StateOp.UNREGISTER: _Entries,
        StateOp.HEARTBEAT: Heartbeat,
        StateOp.LOOKUP: _Keys,
        StateOp.STATS: Stats,
    }
)
"""The typed metadata of the directory's requests (:class:`~kvtier.kvstore.wire.protocol.Schemas`)."""
PULL_REQUESTS = Schemas({StateOp.HELLO: Hello, StateOp.PULL: Pull})
"""... and of a StateBlock server's."""


def host_field(meta: dict[str, Any]) -> str:
    host = wire.field(meta, "host", str)
    if not 0 < len(host) <= 256:
        raise wire.bad("host id must be 1..256 characters")
    return host


def addr_field(meta: dict[str, Any]) -> tuple[str, int]:
    addr = meta.get("addr")
    if (
        not isinstance(addr, list)
        or len(addr) != 2
        or not isinstance(addr[0], str)
        or not isinstance(addr[1], int)
        or not 0 < addr[1] < 65536
    ):
        raise wire.bad("addr must be [ip, port]")
    return addr[0], addr[1]


def lookup_reply(
    hosts: np.ndarray, addrs: list[tuple[str, int]], slots: np.ndarray, gens: np.ndarray
) -> dict[str, Any]:
    return {
        "host": hosts.astype("<i2").tobytes(),
        "addrs": [list(a) for a in addrs],
        "slot": slots.astype("<u4").tobytes(),
        "gen": gens.astype("<u8").tobytes(),
    }


@dataclass
class Location:
    """A StateBlock on a host: pull it from ``addr`` naming ``slot`` and ``generation``."""

    addr: tuple[str, int]
    slot: int
    generation: int


def parse_lookup(meta: dict[str, Any], n: int) -> list[Location | None]:
    hosts = wire.unpack_array(meta, "host", "<i2", n)
    slots = wire.unpack_array(meta, "slot", "<u4", n)
    gens = wire.unpack_array(meta, "gen", "<u8", n)
    addrs = [(str(a[0]), int(a[1])) for a in meta.get("addrs", [])]
    out: list[Location | None] = []
    for h, s, g in zip(hosts.tolist(), slots.tolist(), gens.tolist(), strict=True):
        if h < 0:
            out.append(None)
        elif h >= len(addrs):
            raise wire.bad(f"host index {h} beyond the {len(addrs)} addresses given")
        else:
            out.append(Location(addrs[h], s, g))
    return out


def pull_meta(key: bytes, slot: int, generation: int) -> dict[str, Any]:
    return {"key": key, "slot": slot, "gen": generation}


def parse_pull(meta: dict[str, Any]) -> tuple[bytes, int, int]:
    key = wire.field(meta, "key", bytes)
    if len(key) not in wire.KEY_LENGTHS:
        raise wire.bad(f"key length {len(key)} is not one of {wire.KEY_LENGTHS}")
    return key, wire.field(meta, "slot", int), wire.field(meta, "gen", int)
