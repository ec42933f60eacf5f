"""kvbench putget ``--vs-redis``: the same phases against a local ``redis-server`` (pipelined SET, MGET)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.kvstore.cluster.children import die_with_parent
from kvtier.tools.benchutil import free_port, raw_stream_gbps
from kvtier.tools.kvbench.common import (
    SERVICE_START_TIMEOUT_S,
    BenchError,
    ProgressView,
    UsageError,
    stop_process,
    wait_port,
)
from kvtier.tools.kvbench.phases import Session, Spec, block_views, run_putget, with_raw


class RedisSession(Session):
    """Blocks as plain Redis values: pipelined SET, one MGET per batch (redis-py)."""

    poison_destination = False  # MGET returns new bytes objects; verify compares those

    def __init__(self, port: int) -> None:
        import redis

        self.redis = redis.Redis(host="127.0.0.1", port=port, socket_timeout=300, socket_connect_timeout=10)
        self._values: list[bytes | None] = []

    def attach(self, src: bytearray, dst: bytearray, spec: Spec) -> None:
        super().attach(src, dst, spec)
        self.src_views = block_views(src, spec.block_size)

    def put(self, keys: list[bytes]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for key, view in zip(keys, self.src_views, strict=True):
            pipe.set(key, view)
        replies = pipe.execute()
        if not all(replies):
            raise BenchError(f"redis refused {sum(not r for r in replies)} of {len(keys)} SETs")

    def get(self, keys: list[bytes]) -> list[bool]:
        self._values = self.redis.mget(keys)
        return [v is not None for v in self._values]

    def delete(self, keys: list[bytes]) -> None:
        self.redis.delete(*keys)

    def verify(self, keys: list[bytes]) -> int:
        values = self._values
        self._values = []
        if all(v is not None and len(v) == self.spec.block_size for v in values) and b"".join(values) == self.src:
            return -1
        for i, (value, view) in enumerate(zip(values, self.src_views, strict=True)):
            if value != view:
                return i
        return -1

    def close(self) -> None:
        self.redis.close()


def check_redis() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise UsageError(
            "--vs-redis needs redis-server, which is not on PATH; install it: apt-get install -y redis-server"
        )
    if importlib.util.find_spec("redis") is None:
        raise UsageError("--vs-redis needs the redis Python package; install it: pip install redis")
    return exe


@contextlib.contextmanager
def _redis_server(exe: str, directory: Path) -> Iterator[int]:
    """redis-server on a free loopback port, no persistence; yields the port."""
    import redis

    log = directory / "redis.log"
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    cmd += ["--dir", str(directory), "--logfile", str(log), "--daemonize", "no"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        wait_port(port, proc, "redis-server", log)
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=5)
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.BusyLoadingError:
                if time.monotonic() > deadline:
                    raise BenchError("redis-server did not finish loading") from None
                time.sleep(0.05)
        client.close()
        yield port
    finally:
        stop_process(proc)


def run_redis(exe: str, spec: Spec, progress: ProgressView) -> dict[str, Any]:
    import redis

    with tempfile.TemporaryDirectory(prefix="kvbench-redis-") as tmp, _redis_server(exe, Path(tmp)) as port:
        sessions = [RedisSession(port) for _ in range(spec.concurrency)]
        try:
            result, _ = run_putget("redis", sessions, spec, progress)
            result["version"] = str(sessions[0].redis.info("server").get("redis_version", "?"))
        except redis.RedisError as exc:
            raise BenchError(f"redis: {exc}") from None
        finally:
            for s in sessions:
                s.close()
    return with_raw(result, raw_stream_gbps(result["put"]["bytes"]))
