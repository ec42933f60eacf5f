"""Floods of connections for the tenant-isolation tests: idle connections that never send HELLO, kept up by
processes of their own (reconnecting whenever a server closes one) from chosen loopback addresses or, for a Unix
socket, from forked processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

FLOOD = textwrap.dedent(
    """
    import json, os, select, socket, sys, time

    spec = json.loads(sys.argv[1])

    def connect(target, source):
        if target[0] == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(target[1])
        else:
            sock = socket.create_connection((target[1], target[2]), timeout=2, source_address=(source, 0))
        sock.setblocking(False)
        return sock

    def hold():
        wanted = [(tuple(t), s) for t in spec["targets"] for s in spec["sources"] for _ in range(spec["per_source"])]
        held = {}
        waiting = list(wanted)
        while True:
            for key in waiting:
                try:
                    held[connect(*key)] = key
                except OSError:
                    pass
            waiting = [k for k in wanted if sum(1 for v in held.values() if v == k) < wanted.count(k)]
            if not spec.get("said"):
                spec["said"] = True
                print("ready", flush=True)
            readable = select.select(list(held), [], [], spec["pause_s"])[0]
            for sock in readable:  # closed by the server (or an ERROR before that): drop it, connect again
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    held.pop(sock)
                    sock.close()
            time.sleep(spec["pause_s"])

    children = []
    for _ in range(spec["processes"] - 1):
        pid = os.fork()
        if pid == 0:
            spec["said"] = True
            hold()
        children.append(pid)
    hold()
    """
)


class Flood:
    """A process (or ``processes`` forked ones) keeping ``per_source`` idle, unauthenticated connections to each
    target from each source address; a target is ``("tcp", host, port)`` or ``("unix", path)``. A context manager:
    started on entry (once its first connections are up), killed with its children on exit."""

    def __init__(
        self,
        targets: Sequence[tuple[str, str, int] | tuple[str, str]],
        sources: Sequence[str] = ("127.0.0.1",),
        per_source: int = 4,
        processes: int = 1,
        pause_s: float = 0.02,
    ) -> None:
        spec = {
            "targets": [list(t) for t in targets],
            "sources": list(sources),
            "per_source": per_source,
            "processes": processes,
            "pause_s": pause_s,
        }
        self.argv = [sys.executable, "-c", FLOOD, json.dumps(spec)]
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Flood:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        import os
        import signal

        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)  # (its forked children are in its session)
        self.proc.wait()


def unix_target(path: Path) -> tuple[str, str]:
    return ("unix", str(path))
