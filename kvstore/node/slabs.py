"""Slab files: fixed-size slots per size class, memory-mapped so shards move without copies.

``slabs/slab-<class bytes>.dat`` holds slot ``n`` of its class at offset ``n * class bytes``. A file is
mapped in extents of about 64 MiB (a whole number of slots, so no slot straddles two maps); it is grown
sparsely by whole extents with ``ftruncate`` so that every mapped byte lies inside the file, and the
slots actually handed out are reserved on disk with ``posix_fallocate``. Writes into a reserved slot
therefore cannot fail for lack of space, and a full disk shows up as :class:`NoSpace` at allocation.

Nodes receive shard payloads into a small reused buffer and ``pwrite`` them to their slot (``location``),
so no slab page is mapped and zero-filled before its bytes arrive, and send them from slot views
(``sendmsg``): the copies are the kernel's, between socket buffers, that buffer and the page cache.

Free slots live in memory: rebuilt from the shard records at open, then maintained here. A released slot
is reused only after its grace time, so a read that found it keeps valid bytes. The caller serialises
calls (the chunk engine holds its lock).

Freed slots are handed out in runs of adjacent slots, longest first (:class:`FreeSlots`). At capacity every
put lands in freed slots, and an eviction frees one primary's blocks: at any node those are every twelfth
slot or so (the group's primaries take turns), so handing out the most recently freed slots scattered a
put's shards, one ``pwritev`` each (a 64 KiB-block put at capacity: 29,000 calls in 8 s at one node, 600
into an empty cluster). Runs form again as the other primaries evict their blocks of the same age.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import mmap
import os
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvtier.kvstore import _native
from kvtier.kvstore.node.disk import FULL_ERRNOS, DiskBudget, NoSpace


def _size_classes() -> list[int]:
    sizes = set()
    for power in range(12, 27):
        for quarter in (4, 5, 6, 7):
            size = (1 << power) * quarter // 4
            if size <= 64 << 20:
                sizes.add(size)
    return sorted(sizes)


SIZE_CLASSES = _size_classes()  # 4 KiB … 64 MiB in quarter-power steps: at most ~20 % slack per shard
MAX_SHARD_BYTES = SIZE_CLASSES[-1]
EXTENT_BYTES = 64 << 20
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if os.uname().sysname == "Linux" else 0)


def size_class_for(length: int) -> int:
    """Index into SIZE_CLASSES of the smallest class that holds ``length`` bytes."""
    if length > MAX_SHARD_BYTES:
        raise ValueError(f"shard of {length} bytes exceeds the largest size class ({MAX_SHARD_BYTES})")
    return bisect.bisect_left(SIZE_CLASSES, length)


def _extent_slots(size: int) -> int:
    step = mmap.ALLOCATIONGRANULARITY // math.gcd(size, mmap.ALLOCATIONGRANULARITY)
    return max(step, EXTENT_BYTES // size // step * step)


_EXTENT_SLOTS = [_extent_slots(size) for size in SIZE_CLASSES]
_EXTENT_SLOTS_ARRAY = np.asarray(_EXTENT_SLOTS, dtype=np.int64)
_CLASS_BYTES_ARRAY = np.asarray(SIZE_CLASSES, dtype=np.int64)
POPULATE_MIN_BYTES = 64 << 10  # below this, a handful of page faults cost less than the system call


def by_class(classes: np.ndarray, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``rows`` grouped by their size class (``classes[rows]``), ascending: (class, its rows); one group without
    a sort in the usual case (a put's or an eviction's shards are of one size)."""
    if not len(rows):
        return []
    mine = classes[rows]
    first = int(mine[0])
    if (mine == first).all():
        return [(first, rows)]
    return [(c, rows[mine == c]) for c in np.unique(mine).tolist()]


class Pins:
    """The slots readers are sending, held per read: ``hold`` keeps a read's (size classes, slots) arrays under a
    number and ``release`` lets them go, one dict operation each however many shards the read has (a count per
    slot, kept in numpy arrays, cost a GET a dozen numpy calls, several times dearer in a node woken cold). The
    questions asked of the pins, by deletes, evictions and reaps (rarer than reads): whether a slot is pinned
    (``(size class, slot) in pins``, ``pinned``) and how many are (``len``), answered from the holds merged into
    one sorted array, kept until the holds change. A slot held by two reads stays pinned until both let go."""

    def __init__(self) -> None:
        self._holds: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._last = 0
        self._merged: np.ndarray | None = None  # every held slot as class << 40 | slot, sorted, once each

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, key: object) -> bool:
        size_class, slot = key  # type: ignore[misc]
        return bool(self.pinned(np.asarray([size_class], np.int64), np.asarray([slot], np.int64))[0])

    def hold(self, classes: np.ndarray, slots: np.ndarray) -> int:
        """Pin (``classes[i]``, ``slots[i]``) until ``release`` of the number returned."""
        self._last += 1
        if len(slots):
            self._holds[self._last] = (classes, slots)
            self._merged = None
        return self._last

    def release(self, hold: int) -> None:
        """Let go of what ``hold`` pinned (nothing if it pinned nothing, or was let go already)."""
        if self._holds.pop(hold, None) is not None:
            self._merged = None

    def pinned(self, classes: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether each (``classes[i]``, ``slots[i]``) is pinned, as one array."""
        if not self._holds:
            return np.zeros(len(slots), dtype=bool)
        merged, asked = self._keys(), _slot_keys(classes, slots)
        at = np.minimum(np.searchsorted(merged, asked), len(merged) - 1)
        return merged[at] == asked

    def _keys(self) -> np.ndarray:
        if self._merged is None:
            held = [_slot_keys(classes, slots) for classes, slots in self._holds.values()]
            self._merged = np.unique(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
        return self._merged


def _slot_keys(classes: np.ndarray, slots: np.ndarray) -> np.ndarray:
    return (np.asarray(classes, dtype=np.int64) << 40) | np.asarray(slots, dtype=np.int64)


class FreeSlots:
    """The free slots of one size class, handed out in runs of adjacent slots, longest run first (see the module
    docstring). Slots ``add``ed are merged in at the next ``take``: one sort per batch of releases (an
    eviction's DELETE), not per put; between releases a ``take`` walks the runs already ordered."""

    def __init__(self, slots: Sequence[int] | np.ndarray = ()) -> None:
        self._added: list[np.ndarray] = []
        self._starts = self._ends = np.zeros(0, dtype=np.int64)  # runs [start, end), longest first
        self._run = 0  # runs before this one are taken; of this one, the slots before ``_starts[_run]``
        self._count = 0
        self.add(slots)

    def __len__(self) -> int:
        return self._count

    def add(self, slots: Sequence[int] | np.ndarray) -> None:
        """Free ``slots`` (none of them free already)."""
        if len(slots):
            self._added.append(np.asarray(slots, dtype=np.int64))
            self._count += len(slots)

    def take(self, count: int) -> np.ndarray:
        """``count`` free slots (at most ``len(self)``), ascending: whole runs, longest first, then the start of
        the next one."""
        count = min(count, self._count)
        if self._added:
            self._merge()
        if not count:
            return np.zeros(0, dtype=np.int64)
        run = self._run
        taken = np.cumsum(self._ends[run:] - self._starts[run:])
        whole = int(np.searchsorted(taken, count, side="right"))  # runs taken whole; the next one in part
        rest = count - (int(taken[whole - 1]) if whole else 0)
        starts, ends = self._starts[run : run + whole], self._ends[run : run + whole]
        if rest:
            start = int(self._starts[run + whole])
            starts, ends = np.append(starts, start), np.append(ends, start + rest)
            self._starts[run + whole] = start + rest
        self._run = run + whole
        self._count -= count
        return np.sort(_slots_of_runs(starts, ends))

    def _merge(self) -> None:
        """Fold the added slots into the runs and order them again."""
        left = _slots_of_runs(self._starts[self._run :], self._ends[self._run :])
        slots = np.sort(np.concatenate([left, *self._added]))
        self._added = []
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        starts, ends = slots[np.r_[0, breaks]], slots[np.r_[breaks - 1, len(slots) - 1]] + 1
        order = np.argsort(starts - ends, kind="stable")  # longest first; equal lengths in slot order
        self._starts, self._ends, self._run = starts[order], ends[order], 0


def _slots_of_runs(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Every slot of the runs [``starts[i]``, ``ends[i]``), run after run."""
    lengths = ends - starts
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))


class SlabFiles:
    """Slot allocation and mapped views over one node's slab files."""

    def __init__(self, directory: Path, budget: DiskBudget | None = None) -> None:
        """``budget``: the share of the filesystem new slots may take (none: all of it, up to ENOSPC)."""
        self.directory = directory
        self.budget = budget
        directory.mkdir(parents=True, exist_ok=True)
        self.fds: dict[int, int] = {}
        self.next_slot: dict[int, int] = {}  # slots of the class handed out at least once
        self.free: defaultdict[int, FreeSlots] = defaultdict(FreeSlots)
        self.quarantine: deque[tuple[float, int, int]] = deque()  # (reusable after, class, slot)
        self.quarantined_bytes = 0
        self.pins = Pins()  # slots whose bytes a reader is still sending
        self.maps: dict[tuple[int, int], mmap.mmap] = {}
        self.map_views: dict[tuple[int, int], memoryview] = {}  # one view per map: slicing it is cheap
        self._bases = np.zeros((len(SIZE_CLASSES), 0), dtype=np.int64)  # [class, extent]: its mapping's address
        self._anchors: list[memoryview] = []  # an empty view of each mapping (``addresses``)

    @staticmethod
    def extent_slots(size_class: int) -> int:
        """Slots per mapped extent: about EXTENT_BYTES, and a whole number of mmap granules, because
        every extent's file offset must be a multiple of ``mmap.ALLOCATIONGRANULARITY``."""
        return _EXTENT_SLOTS[size_class]

    def rebuild(self, used: dict[int, set[int]]) -> None:
        """Take the slots in use from the shard records; everything else below the high mark is free."""
        for size_class, slots in used.items():
            self.next_slot[size_class] = max(slots) + 1
            self.free[size_class] = FreeSlots([s for s in range(max(slots)) if s not in slots])

    def fd(self, size_class: int) -> int:
        """The open slab file of a class (created on first use); it lives until ``close``."""
        fd = self.fds.get(size_class)
        if fd is None:
            path = self.directory / f"slab-{SIZE_CLASSES[size_class]}.dat"
            fd = self.fds[size_class] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def allocate(self, size_class: int, count: int) -> np.ndarray:
        """``count`` slots of a class, in ascending order (adjacent slots are written in one call): freed ones
        first (in runs, :class:`FreeSlots`), then new ones reserved on disk in one call. NoSpace (nothing taken)
        when the new ones would take the filesystem past the budget, or it has no room."""
        free = self.free[size_class]
        reused = free.take(count)
        new = count - len(reused)
        if not new:
            return reused
        first = self.next_slot.get(size_class, 0)
        size = SIZE_CLASSES[size_class]
        fd = self.fd(size_class)
        per_extent = self.extent_slots(size_class)
        end_extent = -(-(first + new) // per_extent)
        try:
            if self.budget is not None:
                self.budget.check(new * size)
            if os.fstat(fd).st_size < end_extent * per_extent * size:
                os.ftruncate(fd, end_extent * per_extent * size)
            os.posix_fallocate(fd, first * size, new * size)
        except NoSpace:
            free.add(reused)
            raise
        except OSError as exc:
            free.add(reused)
            if exc.errno in FULL_ERRNOS:
                raise NoSpace(f"disk full under {self.directory}") from None
            raise
        self.next_slot[size_class] = first + new
        return np.concatenate([reused, np.arange(first, first + new, dtype=np.int64)])

    def location(self, size_class: int, slot: int) -> tuple[int, int]:
        """(file descriptor, byte offset) of a slot, for ``pwrite``; the descriptor lives until ``close``."""
        return self.fd(size_class), slot * SIZE_CLASSES[size_class]

    def write(self, size_class: int, slot: int, data: bytes | memoryview) -> None:
        """Write ``data`` at the start of a slot."""
        fd, offset = self.location(size_class, slot)
        view = memoryview(data).cast("B")
        while view:
            view = view[os.pwrite(fd, view, offset + (len(data) - len(view))) :]

    def view(self, size_class: int, slot: int, length: int, for_write: bool = False) -> memoryview:
        """A view of the first ``length`` bytes of a slot.

        ``for_write`` faults the pages in with one ``MADV_POPULATE_WRITE`` call, so that a socket receive
        into the slot does not take a page fault every 4 KiB.
        """
        per_extent = self.extent_slots(size_class)
        extent, index = divmod(slot, per_extent)
        size = SIZE_CLASSES[size_class]
        whole = self.map_views.get((size_class, extent))
        if whole is None:
            mapped = mmap.mmap(self.fd(size_class), per_extent * size, offset=extent * per_extent * size)
            self.maps[(size_class, extent)] = mapped
            whole = self.map_views[(size_class, extent)] = memoryview(mapped)
            self._anchors.append(whole[:0])  # an export of the mapping: it cannot be closed while this lives
            if extent >= self._bases.shape[1]:
                grown = np.zeros((len(SIZE_CLASSES), max(2 * self._bases.shape[1], extent + 1)), dtype=np.int64)
                grown[:, : self._bases.shape[1]] = self._bases
                self._bases = grown
            self._bases[size_class, extent] = np.frombuffer(_native.addresses([whole]), dtype=np.int64)[0]
        if for_write and _POPULATE_WRITE and length >= POPULATE_MIN_BYTES:
            with contextlib.suppress(OSError):  # older kernels: the faults happen during the receive
                self.maps[(size_class, extent)].madvise(
                    _POPULATE_WRITE, index * size, -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
                )
        return whole[index * size : index * size + length]

    def release(
        self, classes: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray, after: float, now: float
    ) -> int:
        """Make (``classes[i]``, ``slots[i]``) reusable once the clock passes ``after`` and no reader pins them.
        Those that may be reused already (``after`` is not in the future, and unpinned) go straight to the free
        lists; returns their bytes. The others wait in quarantine for ``reap``."""
        if not len(slots):
            return 0
        classes, numbers = np.asarray(classes, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        held = self.pins.pinned(classes, numbers) if after <= now else np.ones(len(numbers), dtype=bool)
        freed = 0
        for size_class, mine in by_class(classes, np.arange(len(numbers))):
            waiting = mine[held[mine]]
            reusable = numbers[mine[~held[mine]]] if len(waiting) else numbers[mine]
            self.free[size_class].add(reusable)
            freed += len(reusable) * SIZE_CLASSES[size_class]
            self.quarantine.extend((after, size_class, slot) for slot in numbers[waiting].tolist())
            self.quarantined_bytes += len(waiting) * SIZE_CLASSES[size_class]
        return freed

    def release_now(self, size_class: int, slot: int) -> None:
        """Make a slot reusable at once (it was never visible to any reader)."""
        self.free[size_class].add([slot])

    def pin(self, classes: np.ndarray | Sequence[int], slots: np.ndarray | Sequence[int]) -> int:
        """A reader is sending these (``classes[i]``, ``slots[i]``): they are not reused until ``unpin`` of the
        number returned."""
        return self.pins.hold(np.asarray(classes, dtype=np.int64), np.asarray(slots, dtype=np.int64))

    def unpin(self, hold: int) -> None:
        """Release what ``pin`` pinned under ``hold``."""
        self.pins.release(hold)

    def addresses(self, classes: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, list[memoryview]]:
        """Where each (``classes[i]``, ``slots[i]``) starts in memory (int64 addresses into the slab mappings,
        mapped now where not yet), and what keeps those mappings from being closed while it is referenced (pass
        it along with the addresses, as ``_native.Scatter`` does). One table lookup per call once mapped."""
        per_extent = _EXTENT_SLOTS_ARRAY[classes]
        extent = slots // per_extent
        if len(extent) and (int(extent.max()) >= self._bases.shape[1] or not self._bases[classes, extent].all()):
            for c, e in set(zip(classes.tolist(), extent.tolist(), strict=True)):
                self.view(c, e * _EXTENT_SLOTS[c], 0)  # maps it
        return self._bases[classes, extent] + (slots - extent * per_extent) * _CLASS_BYTES_ARRAY[classes], self._anchors

    def reap(self, now: float) -> int:
        """Free the quarantined slots whose grace has passed and that no reader pins; returns their bytes."""
        freed = 0
        still_pinned = []
        while self.quarantine and self.quarantine[0][0] <= now:
            entry = self.quarantine.popleft()
            if (entry[1], entry[2]) in self.pins:
                still_pinned.append(entry)
                continue
            self.free[entry[1]].add([entry[2]])
            freed += SIZE_CLASSES[entry[1]]
        self.quarantine.extendleft(reversed(still_pinned))
        self.quarantined_bytes -= freed
        return freed

    def close(self) -> None:
        self._bases = np.zeros((len(SIZE_CLASSES), 0), dtype=np.int64)
        self._anchors = []  # a payload in flight keeps the old list, and with it its mappings
        for view in self.map_views.values():
            view.release()
        self.map_views.clear()
        for mapped in self.maps.values():
            with contextlib.suppress(BufferError):  # a view still held by a dying connection thread
                mapped.close()
        self.maps.clear()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
