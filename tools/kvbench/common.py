"""What every kvbench subcommand shares: its errors, progress views, and child-process helpers.

A subcommand module ``tools/kvbench/NAME.py`` has ``register(commands: Subcommands) -> None``
(``tools.cliutil``); its ``run(args)`` returns the exit status, or raises :class:`UsageError` (exit status 2),
:class:`VerifyError` or :class:`BenchError` (exit status 1), each shown as one line.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.kvstore.cluster.config import ClusterConfig

PROG = "kvbench"
SHOW_PROGRESS_AFTER_S = 2.0
SERVICE_START_TIMEOUT_S = 60.0


class UsageError(Exception):
    """Something the user can fix (an option, a cluster file, a missing program); one line, exit status 2."""


class BenchError(Exception):
    """A run that failed (a store refused or broke); one line, exit status 1."""


class VerifyError(BenchError):
    """A read came back missing or with wrong bytes."""


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The cluster of ``kvbench --config PATH`` as a client sees it, with the token from
    ``--token-file``, ``$KVTIER_TOKEN``, else the file's own; UsageError (one line) when it cannot be loaded."""
    from kvtier.kvstore.cluster import config as cluster_mod
    from kvtier.kvstore.cluster import map as cluster_map

    try:
        token = cluster_mod.read_token_file(args.token_file) if getattr(args, "token_file", None) else None
        return cluster_map.load_client(args.config, token)
    except cluster_mod.ConfigError as exc:
        raise UsageError(str(exc)) from None


# --- progress ---------------------------------------------------------------------------------------------------


class ProgressView:
    """Progress of the running phase. This base class shows nothing (``--json``, or stderr not a terminal)."""

    def start(self, label: str, total: float) -> None:
        pass

    def update(self, label: str, completed: float) -> None:
        pass

    def finish(self, label: str) -> None:
        pass

    def close(self) -> None:
        pass


class RichProgress(ProgressView):
    """rich bars on stderr, shown once a phase has run for a couple of seconds, removed when it ends."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._progress.start()
        self._tasks: dict[str, tuple[Any, float]] = {}

    def start(self, label: str, total: float) -> None:
        task = self._progress.add_task(label, total=max(total, 1e-9), visible=False)
        self._tasks[label] = (task, time.monotonic())

    def update(self, label: str, completed: float) -> None:
        if label not in self._tasks:
            return
        task, started = self._tasks[label]
        visible = time.monotonic() - started >= SHOW_PROGRESS_AFTER_S
        self._progress.update(task, completed=completed, visible=visible)

    def finish(self, label: str) -> None:
        if label in self._tasks:
            task, _ = self._tasks.pop(label)
            self._progress.remove_task(task)

    def close(self) -> None:
        self._progress.stop()


class JsonLinesProgress(ProgressView):
    """Progress as JSON lines on stdout: how a benchmark child process reports to kvbench."""

    def _emit(self, **fields: Any) -> None:
        print(json.dumps({"progress": fields}), flush=True)

    def start(self, label: str, total: float) -> None:
        self._emit(event="start", label=label, total=total)

    def update(self, label: str, completed: float) -> None:
        self._emit(event="update", label=label, completed=completed)

    def finish(self, label: str) -> None:
        self._emit(event="finish", label=label)


# --- child processes ----------------------------------------------------------------------------------------------


def last_line(path: Path) -> str:
    """The line of a child's log that most likely says why it failed: a Python exception, else the last glog
    error (``E`` + date), else the last line."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    if not lines:
        return "(empty log)"
    if any(ln.startswith("Traceback") for ln in lines):
        return lines[-1]
    errors = [ln for ln in lines if len(ln) > 5 and ln[0] in "EF" and ln[1:5].isdigit()]
    return errors[-1] if errors else lines[-1]


def stop_process(proc: subprocess.Popen[Any] | None, timeout_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_port(port: int, proc: subprocess.Popen[Any], what: str, log: Path) -> None:
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with code {proc.returncode}: {last_line(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"{what} did not listen on port {port} within {SERVICE_START_TIMEOUT_S:.0f} s")
