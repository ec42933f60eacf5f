"""Shared fixtures: real local clusters of node processes in temporary directories."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster, NodeStartError
from kvtier.kvstore.units import format_size

ClusterFactory = Callable[..., LocalCluster]


def _import_installed(name: str) -> None:
    """Import the installed package ``name`` ahead of a same-named folder of this repository: pytest puts the
    repository root on ``sys.path`` (for ``tests`` and ``dev``), where ``kernels/`` (``kvtier.kernels``) would shadow
    Hugging Face's ``kernels``, which transformers ≥ 5.25 imports."""
    root = Path(__file__).resolve().parent.parent
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        __import__(name)
    except ImportError:
        pass
    finally:
        sys.path[:] = saved


_import_installed("kernels")


# The files that load this 2-core machine most (node processes by the dozen busy for minutes, a new environment
# installed). Under ``make test`` (pytest-xdist, two workers) they are one unit of work, run one after another on
# one worker; every other file is a unit of its own, so its module-scoped clusters start once, on one worker.
HEAVY = {
    "test_demo.py",
    "test_gc.py",
    "test_durability.py",
    "test_store.py",
    "test_cluster_map.py",
    "test_replay_live.py",
    "test_multihost.py",
}


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker picks ports (cluster files, servers) from a range of its own, inherited by what it starts:
    a node killed and started again binds its port again, and the other worker's next cluster file could have
    taken it in between (``Address already in use`` at the restart)."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and workers and cluster_mod.PORT_RANGE_ENV not in os.environ:
        low, high = cluster_mod.port_range(1)
        share = (high - low) // int(workers)
        first = low + share * int(worker.removeprefix("gw"))
        os.environ[cluster_mod.PORT_RANGE_ENV] = f"{first}-{first + share}"


HEADROOM_BYTES = cluster_mod.GCConfig().max_headroom_bytes  # what a node leaves free on a large disk


class DiskWatch:
    """The free space of the disk under the tests' temporary directories, at the start, at its least (sampled every
    few seconds by a daemon thread of the process that reports, ``watch``) and at the end: nodes refuse new slots
    where less than their headroom would stay free (on a large disk ``gc.max_headroom_bytes``), and the suite's
    clusters take a few GiB at once, so a run on a disk that others filled fails its writes (``CapacityError``), and
    the summary says so."""

    def __init__(self) -> None:
        self.start = self.least = self.free()

    @staticmethod
    def free() -> int:
        stats = os.statvfs(tempfile.gettempdir())
        return stats.f_bavail * stats.f_frsize

    def watch(self) -> None:
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            time.sleep(5)
            self.least = min(self.least, self.free())

    def header(self) -> str:
        stats = os.statvfs(tempfile.gettempdir())
        used = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
        low = 6 * HEADROOM_BYTES
        headroom = format_size(HEADROOM_BYTES)
        warning = f"; under {format_size(low)} free: nodes refuse writes with less than {headroom} free"
        return (
            f"disk under the tests' files: {used / (used + self.start):.0%} used, {format_size(self.start)} free"
            f"{warning if self.start < low else ''}"
        )

    def summary(self) -> str:
        return (
            f"disk under the tests' files: {format_size(self.start)} free at the start, {format_size(self.least)} at "
            f"the least, {format_size(self.free())} at the end"
        )


DISK = DiskWatch()


def pytest_sessionstart(session: pytest.Session) -> None:
    """The disk is watched by the process that reports (not by each xdist worker)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        DISK.watch()


def pytest_report_header(config: pytest.Config) -> str:
    return DISK.header()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Iterator[None]:
    """After the short summary of the failures (the terminal reporter writes it once the other hooks have run), where
    the end of a long output shows it."""
    yield
    terminalreporter.write_line(DISK.summary())


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without it (no -n) nothing calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's file-scoped scheduler with the heavy files as one scope (xdist's own ``xdist_group`` marks do not
    reach pytest 9's node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndHeavy(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "heavy" if Path(file).name in HEAVY else file

    return FilesAndHeavy(config, log)


@pytest.fixture(autouse=True, scope="session")
def no_token_from_the_shell() -> Iterator[None]:
    """Tests choose the token each client presents: a ``KVTIER_TOKEN`` (or ``KVTIER_CONFIG``) exported in the shell
    that runs them must not choose it for them."""
    saved = {name: os.environ.pop(name) for name in ("KVTIER_TOKEN", "KVTIER_CONFIG") if name in os.environ}
    yield
    os.environ.update(saved)


@pytest.fixture(scope="module")
def make_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFactory]:
    """Start a 12-node cluster: ``make_cluster(capacity_bytes=..., extra_toml=...)``; stopped after the module."""
    started: list[LocalCluster] = []

    def factory(capacity_bytes: int = 256 << 20, extra_toml: str = "", nodes: int = 12, gc: str = "") -> LocalCluster:
        """``gc``: lines for the [gc] table (replacing the file's own settings of the same names);
        ``extra_toml``: more tables appended to the file.

        The cluster file takes free ports when it is written; another process on this machine (parallel test
        runs) may bind one before the node does, so a start that fails for that is retried on fresh ports.
        """
        tries = 3
        while True:
            tries -= 1
            directory = tmp_path_factory.mktemp("cluster")
            path = cluster_mod.write_default(directory, nodes=nodes, capacity_bytes=capacity_bytes)
            settings = {line.split("=")[0].strip() for line in gc.splitlines() if "=" in line}
            text = "".join(
                line
                for line in path.read_text().splitlines(keepends=True)
                if line.split("=")[0].strip() not in settings
            )
            text = text.replace("[gc]\n", f"[gc]\n{gc}")
            path.write_text(text + ("\n" + extra_toml + "\n" if extra_toml else ""))
            local = LocalCluster(path)
            started.append(local)
            try:
                local.start()
                return local
            except NodeStartError as exc:
                local.stop()
                if "Address already in use" not in str(exc) or not tries:
                    raise

    yield factory
    for local in started:
        discard(local)


def discard(local: LocalCluster) -> None:
    """Stop ``local`` and remove what its nodes stored (slab files, metadata), keeping their logs: a test run
    starts some 170 clusters of ~100-300 MB each, which together filled the disk until every node refused writes
    (its slabs leave the filesystem a headroom, ``gc.max_headroom_bytes`` on a large one)."""
    local.stop()
    for node in local.config.nodes.values():
        for stored in ("slabs", "meta"):
            shutil.rmtree(node.data_dir / stored, ignore_errors=True)


@pytest.fixture
def own_cluster(make_cluster: ClusterFactory) -> Iterator[ClusterFactory]:
    """``make_cluster``, but each cluster is stopped as soon as its test ends (idle nodes still run GC)."""
    made: list[LocalCluster] = []

    def factory(**kwargs) -> LocalCluster:
        made.append(make_cluster(**kwargs))
        return made[-1]

    yield factory
    for local in made:
        discard(local)


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Return as soon as ``condition()`` is true; fail the test, naming ``what``, if it is not by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def cluster_path(local: LocalCluster) -> Path:
    return local.config_path


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real filesystem of ``size`` mounted at ``path``, to fill up; skips the test where mounting is not
    allowed (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB filesystem."""
    with tmpfs(tmp_path / "small-disk", "2m") as path:
        yield path


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module's tests: two busy cores (more threads only spin), and the engine baseline
    was computed with one. torch is imported here, not at the top: the store's tests run without it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine() -> Iterator[Callable[..., Any]]:
    """Makes engines (``engine(checkpoint, store, states=None, **from_pretrained_options)``: a store, a StateBlock
    pool, a fetcher as given; a cache of 8,192 tokens) and closes every one it made when the test ends."""
    from kvtier.engine.engine import Engine

    made: list[Engine] = []

    def make(checkpoint: Path, store: Path | None, states: Any = None, **kw: Any) -> Engine:
        made.append(Engine.from_pretrained(checkpoint, store=store, state_blocks=states, cache_tokens=8192, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny seed-0 checkpoint, written once per module."""
    from kvtier.engine.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., str]]:
    """``start_server(*serve_args)`` runs ``kvtier-engine serve`` as a process and returns its base URL once
    ``/health`` answers 200; every server started is stopped (SIGTERM) after the module."""
    import sys
    import urllib.request

    from kvtier.tools.benchutil import free_port

    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, timeout_s: float = 180.0) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "kvtier.serving.cli", "serve", "--port", str(port), *args]
        proc = subprocess.Popen(argv)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with status {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, timeout_s, "the server's /health to answer 200", poll_s=0.2)
        return url

    yield start
    for proc in started:
        proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
