"""The host engines' plug-in base classes, imported when they are installed and stood in for when they are not.

Every adapter module must import on a machine without its engine (``pip install kvtier`` alone, CI, a docs
build), and must say which extra to install the moment it is used there. :func:`host_class` gives the adapter its
base class: the engine's own class when the engine imports, else a stand-in whose instances cannot be made:
:class:`EngineMissing` naming the extra. Nothing of the stand-in imitates the engine's interface.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from typing import Any

log = logging.getLogger("kvtier.adapters")

PINNED = {"sglang": "0.5.23", "vllm": "0.33.0", "lmcache": "0.5.6"}
"""The release whose plug-in interface each adapter was written and tested against (the extras pin it too)."""


class EngineMissing(ImportError):
    """An adapter was used on a machine without its host engine; the message names the extra to install."""


def host_class(engine: str, module: str, name: str) -> type:
    """``module.name`` from ``engine`` if it imports, else a stand-in base: making an instance raises EngineMissing."""
    try:
        found = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        why = f"{exc}"
        return type(name, (_Missing,), {"_engine": engine, "_why": why, "__module__": __name__})
    _warn_if_unpinned(engine)
    return found


class _Missing:
    _engine = ""
    _why = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # before any subclass __init__ runs
        engine = cls._engine
        install = f"pip install 'kvtier[{engine}]'"
        raise EngineMissing(f"{cls.__name__} needs {engine} {PINNED[engine]} ({cls._why}): {install}")


def _warn_if_unpinned(engine: str) -> None:
    try:
        version = importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        return
    if version != PINNED[engine]:
        log.warning(
            "kvtier's %s adapter was written against %s %s; %s is installed: its plug-in interface may differ",
            engine,
            engine,
            PINNED[engine],
            version,
        )
