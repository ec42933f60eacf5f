"""Where StateBlocks live: this process's memory, least recently used first out.

Same two calls as ``kvtier.transfer.StateBlockHost`` (``put``, ``get_into``), which keeps them in a shared
pool and finds other hosts' through the directory; an engine takes either.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class StateBlocks(Protocol):
    def put(self, key: bytes, data: memoryview) -> None: ...

    def get_into(self, key: bytes, out: memoryview) -> bool:
        """Copy the StateBlock ``key`` into ``out`` (exactly its size); False if it is not held."""
        ...


class LocalStateBlocks:
    """At most ``capacity_bytes`` of StateBlocks in this process; the least recently used go first."""

    def __init__(self, capacity_bytes: int = 256 << 20) -> None:
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: bytes, data: memoryview) -> None:
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        self._blocks[key] = bytes(data)
        self._bytes += len(data)
        while self._bytes > self.capacity_bytes:
            _, old = self._blocks.popitem(last=False)
            self._bytes -= len(old)

    def get_into(self, key: bytes, out: memoryview) -> bool:
        data = self._blocks.get(key)
        if data is None or len(data) != len(out):
            return False
        self._blocks.move_to_end(key)
        memoryview(out).cast("B")[:] = data
        return True
