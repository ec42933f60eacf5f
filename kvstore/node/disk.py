"""A node's disk as a budget: the slab files within a share of the filesystem, LMDB's file allocated ahead of use.

Two things on one filesystem can take its last block: the slab files (``posix_fallocate`` of new slots) and LMDB,
which runs with ``writemap`` — a new page is a store into the mapped file, and a store into a page the filesystem
has no block for is a SIGBUS, not an error (the node then died, and died again at every start). Neither may:

- **Slabs** (:class:`DiskBudget`): new slots are reserved only while the filesystem keeps a headroom free: the
  share of its size past ``gc.max_disk_fraction``, but never more than ``gc.max_headroom_bytes`` (as Elasticsearch's
  disk watermarks' ``max_headroom``: on a large disk a share of it is far more than the metadata and the logs need,
  and a disk that others filled past the share would refuse every write with tens of GiB free). Beyond it (or at
  ENOSPC) the reservation is ``NoSpace``. The headroom is for the metadata and the logs, whoever else shares the
  filesystem.
- **Metadata** (:class:`MetaRoom`): before every write transaction the engine asks for room for it; LMDB's file is
  kept allocated (``posix_fallocate``) ``META_AHEAD_BYTES`` past its last page, so a transaction never stores into
  a hole. Room that cannot be allocated is ``NoSpace`` before the transaction starts: nothing is written, nothing
  faults. A node restarted on a full disk finds the blocks it allocated ahead still there.

Every refusal is counted and the first of an episode logged (:class:`Refusals`): "disk full" once, "room again" once.

| what asks | room it needs | without it |
|---|---|---|
| a PUT's new slots | the filesystem's headroom left free | ``NO_SPACE`` for those shards |
| a PUT | its COMMIT's records in LMDB's allocated file | ``NO_SPACE`` for every shard |
| any write transaction (commit, delete, access times, ...) | LMDB's allocated file | ``NoSpace``: nothing written |
| the load at start-up | LMDB's allocated file | dead records stay for a later start; reads are served |
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import lmdb

log = logging.getLogger("kvtier.disk")

META_AHEAD_BYTES = 8 << 20  # LMDB's file is allocated this far past its last page (less where the disk has less)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class NoSpace(Exception):
    """The disk (or the share of it this node may use) has no room for what was asked; nothing was written."""


class Refusals:
    """Refusals for lack of disk, counted (``count``), the first of each episode logged as a warning, the end of an
    episode (``room``) as info. Thread-safe."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.count = 0
        self._full = False
        self._lock = threading.Lock()

    def refused(self, what: str, cause: str) -> None:
        with self._lock:
            self.count += 1
            first, self._full = not self._full, True
        if first:
            log.warning("the disk under %s is full (%s): %s are refused until there is room", self.where, cause, what)

    def room(self) -> None:
        """What was refused fits again."""
        if self._full:
            with self._lock:
                was, self._full = self._full, False
            if was:
                log.info("the disk under %s has room again", self.where)


class DiskBudget:
    """The share of a filesystem the slab files may grow into (see the module docstring)."""

    def __init__(self, path: Path, max_fraction: float, max_headroom_bytes: int | None = None) -> None:
        """``max_headroom_bytes``: the most the budget keeps free, whatever ``max_fraction`` leaves (None: no cap)."""
        self.path = path
        self.max_fraction = max_fraction
        self.max_headroom_bytes = max_headroom_bytes

    def check(self, more_bytes: int) -> None:
        """NoSpace unless ``more_bytes`` more leave the filesystem its headroom: ``1 - max_fraction`` of its size
        (as ``df`` counts it: what is used and what is available, blocks kept for root apart), at most
        ``max_headroom_bytes``."""
        stats = os.statvfs(self.path)
        used = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
        free = stats.f_bavail * stats.f_frsize
        headroom = (1 - self.max_fraction) * (used + free)
        if self.max_headroom_bytes is not None:
            headroom = min(headroom, self.max_headroom_bytes)
        if free - more_bytes < headroom:
            raise NoSpace(
                f"{more_bytes} more bytes would leave {free - more_bytes} of {used + free} free, under the headroom "
                f"of {int(headroom)} (gc.max_disk_fraction {self.max_fraction:g}, gc.max_headroom_bytes "
                f"{self.max_headroom_bytes})"
            )


class MetaRoom:
    """LMDB's file allocated ahead of its last page (see the module docstring). Call ``ensure`` before each write
    transaction, under the lock that serialises them."""

    def __init__(self, env: lmdb.Environment, path: Path, ahead_bytes: int = META_AHEAD_BYTES) -> None:
        """``path``: LMDB's data file. Its lock file (``lock.mdb`` beside it, also mapped: a reader that takes a slot
        on a page never touched stores into it) is allocated whole now, where the disk has room."""
        self.env = env
        self.path = path
        self.ahead_bytes = ahead_bytes
        self.page_bytes = int(env.stat()["psize"])
        self.fd = os.open(path, os.O_RDWR)
        self.allocated = 0  # the file is allocated up to here (known once ``ensure`` extended it in this process)
        lock = path.with_name("lock.mdb")
        if lock.exists():
            fd = os.open(lock, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
            except OSError as exc:
                if exc.errno not in FULL_ERRNOS:
                    raise
            finally:
                os.close(fd)

    def end_bytes(self) -> int:
        """Where LMDB's pages in use end."""
        return (int(self.env.info()["last_pgno"]) + 1) * self.page_bytes

    def ensure(self, need_bytes: int) -> None:
        """Make sure a transaction that adds up to ``need_bytes`` of pages stores only into allocated blocks;
        NoSpace (nothing allocated needs undoing) when the filesystem cannot give them."""
        end = self.end_bytes()
        if end + need_bytes <= self.allocated:
            return
        for target in (end + need_bytes + self.ahead_bytes, end + need_bytes):
            try:  # from where this process allocated to (all of it, the first time: what is allocated stays so)
                os.posix_fallocate(self.fd, self.allocated, target - self.allocated)
            except OSError as exc:
                if exc.errno not in FULL_ERRNOS:
                    raise
                continue
            self.allocated = target
            return
        raise NoSpace(f"no room to grow its metadata {self.path} by {need_bytes} bytes")

    def close(self) -> None:
        os.close(self.fd)
