"""Where kvstore's modules went when the folder became rooms (``wire``, ``cluster``, ``node``, ``client``), kept
for one release: an old name still imports, as the very module it became, with a :class:`MovedWarning` naming
the new one. kvtier's own code, tests and docs use the new names (the test suite turns the warning into an error).

Two kinds of old name: a module that moved into a room (``kvtier.kvstore.protocol`` is
``kvtier.kvstore.wire.protocol``), found by :class:`_OldNames` on ``sys.meta_path``; and a module whose name a room
took (``kvtier.kvstore.node`` was the server, now ``kvtier.kvstore.node.server``), whose names the room's
``__getattr__`` (:func:`forward`) hands out. Remove this module, and the rooms' ``__getattr__``, in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

PACKAGE = "kvtier.kvstore"
# old module under kvtier.kvstore -> where it is now
MOVED = {
    "admission": "wire.admission",
    "block_table": "node.block_table",
    "charges": "node.charges",
    "children": "cluster.children",
    "chunks": "node.chunks",
    "cli": "cluster.cli",
    "client_core": "client.core",
    "client_lookups": "client.lookups",
    "client_reads": "client.reads",
    "client_repair": "client.repair",
    "client_writes": "client.writes",
    "cluster_map": "cluster.map",
    "dead_slots": "node.dead_slots",
    "disk": "node.disk",
    "etcd": "cluster.etcd",
    "held_blocks": "node.held_blocks",
    "local": "cluster.local",
    "lru": "node.lru",
    "membership": "cluster.membership",
    "metrics": "wire.metrics",
    "node_metrics": "node.metrics",
    "node_requests": "wire.requests",
    "owed": "node.owed",
    "protocol": "wire.protocol",
    "quotas": "node.quotas",
    "read_watch": "client.read_watch",
    "removals": "node.removals",
    "shard_index": "node.shard_index",
    "slabs": "node.slabs",
    "sockio": "wire.sockio",
    "transport": "wire.transport",
}
# a room that took the name of a module -> where that module is now
TAKEN = {"cluster": "cluster.config", "node": "node.server", "wire": "wire.fields"}


class MovedWarning(DeprecationWarning):
    """An old kvstore module name was used; the message names the new one."""


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", MovedWarning, stacklevel=3)


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``kvtier.kvstore.<old>`` as the module it became: the placeholder the import system makes is
    replaced in ``sys.modules`` by the real module, so both names are one module object."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, old = fullname.rpartition(".")
        if prefix != PACKAGE or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new = f"{PACKAGE}.{MOVED[module.__name__.rpartition('.')[2]]}"
        _warn(module.__name__, new)
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Put the finder of old names last on ``sys.meta_path`` (once): only names nothing else finds reach it."""
    if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
        sys.meta_path.append(_OldNames())


def forward(room: str) -> Callable[[str], object]:
    """The ``__getattr__`` of a room that took a module's name: a name the room does not have, and that is none of
    its submodules, is looked up in that module, with a warning."""
    old = f"{PACKAGE}.{room}"
    new = f"{PACKAGE}.{TAKEN[room]}"

    def __getattr__(name: str) -> object:
        if name.startswith("__") or importlib.util.find_spec(f"{old}.{name}") is not None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(new), name)
        _warn(f"{old}.{name}", f"{new}.{name}")
        setattr(sys.modules[old], name, value)  # said once
        return value

    return __getattr__
