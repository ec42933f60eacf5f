"""What the swap-in benchmarks share (``swapin.py``, ``swapin_format.py``): host memory like the staging pool's, random
ids, and interleaved timing."""

from __future__ import annotations

import contextlib
import mmap
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from typing import Any


@contextlib.contextmanager
def segment(nbytes: int) -> Iterator[tuple[memoryview, str]]:
    """A fresh POSIX shared-memory segment of ``nbytes`` (unlinked on exit), and what it is. Where /dev/shm has
    less room than that (containers often give it 64 MiB), anonymous memory stands in: writing past a full tmpfs
    would kill the process with SIGBUS."""
    if shutil.disk_usage("/dev/shm").free < nbytes + (64 << 20):
        with mmap.mmap(-1, nbytes) as anonymous:
            view = memoryview(anonymous)
            yield view, "anonymous mmap (/dev/shm too small)"
            view.release()
        return
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        yield shm.buf, "POSIX shared memory"
    finally:
        with contextlib.suppress(BufferError):  # a view outlived an error: the mapping goes with the process
            shm.close()
        shm.unlink()


def random_ids(n: int, space: int, seed: int) -> Any:
    import torch

    return torch.randperm(space, generator=torch.Generator().manual_seed(seed))[:n]


def median_times(methods: dict[str, Callable[[], object]], rounds: int, sync: Callable[[], None]) -> dict[str, float]:
    """Seconds per call, median of ``rounds``, the methods interleaved so a busy neighbour slows them alike."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}
