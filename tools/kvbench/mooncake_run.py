"""kvbench putget ``--vs-mooncake``: the same phases against a local Mooncake Store (zero-copy batch API).

The master, a store server holding the segment and the benchmark client run as separate processes; the
children report as JSON lines on stdout (:class:`~kvtier.tools.kvbench.common.JsonLinesProgress`).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvtier.kvstore.cluster.children import die_with_parent
from kvtier.tools.benchutil import free_port, raw_stream_gbps
from kvtier.tools.kvbench.common import (
    BenchError,
    JsonLinesProgress,
    ProgressView,
    UsageError,
    VerifyError,
    last_line,
    stop_process,
    wait_port,
)
from kvtier.tools.kvbench.phases import Session, Spec, run_putget, with_raw

MOONCAKE_DIST = "mooncake-transfer-engine-non-cuda"


class MooncakeSession(Session):
    """Zero-copy Mooncake Store calls on buffers registered with the (shared, thread-safe) store object."""

    def __init__(self, store: Any, lock: threading.Lock) -> None:
        self.store = store
        self.lock = lock
        self._registered: list[int] = []

    def attach(self, src: bytearray, dst: bytearray, spec: Spec) -> None:
        super().attach(src, dst, spec)
        addresses = []
        for buf in (src, dst):
            address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
            with self.lock:
                rc = self.store.register_buffer(address, len(buf))
            if rc != 0:
                raise BenchError(f"mooncake register_buffer of {len(buf)} bytes returned {rc}")
            self._registered.append(address)
            addresses.append(address)
        n, size = spec.blocks_per_call, spec.block_size
        self.src_ptrs = [addresses[0] + i * size for i in range(n)]
        self.dst_ptrs = [addresses[1] + i * size for i in range(n)]
        self.sizes = [size] * n

    def put(self, keys: list[bytes]) -> None:
        codes = self.store.batch_put_from([k.hex() for k in keys], self.src_ptrs, self.sizes)
        failed = [c for c in codes if c != 0]
        if failed:
            raise BenchError(f"mooncake batch_put_from failed for {len(failed)} of {len(keys)} keys (code {failed[0]})")

    def get(self, keys: list[bytes]) -> list[bool]:
        got = self.store.batch_get_into([k.hex() for k in keys], self.dst_ptrs, self.sizes)
        return [n == self.spec.block_size for n in got]

    def delete(self, keys: list[bytes]) -> None:
        codes = self.store.batch_remove([k.hex() for k in keys], True)  # force: no wait for the read lease
        failed = [c for c in codes if c != 0]
        if failed:
            raise BenchError(f"mooncake batch_remove failed for {len(failed)} of {len(keys)} keys (code {failed[0]})")

    def close(self) -> None:
        with self.lock:
            for address in self._registered:
                self.store.unregister_buffer(address)
        self._registered.clear()


def _mooncake_dir() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / "mooncake_master").exists():
            return Path(location)
    return None


def check_mooncake() -> Path:
    """The folder of the installed ``mooncake`` package, once its store module is known to load."""
    folder = _mooncake_dir()
    if folder is None:
        raise UsageError(f"--vs-mooncake needs Mooncake Store; install it: pip install {MOONCAKE_DIST}")
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=120, check=False
    )
    if probe.returncode != 0:
        lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {probe.returncode}"
        hint = "; install it: apt-get install -y libibverbs1" if "libibverbs" in why else ""
        raise UsageError(f"--vs-mooncake: Mooncake Store does not load here: {why}{hint}")
    return folder


def _mooncake_version() -> str:
    try:
        return importlib.metadata.version(MOONCAKE_DIST)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _child(function: str, params: dict[str, Any], log: Path) -> subprocess.Popen[str]:
    code = f"import sys; from kvtier.tools.kvbench.mooncake_run import {function} as f; sys.exit(f(sys.argv[1]))"
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(params)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            preexec_fn=die_with_parent,
        )


def _read_messages(proc: subprocess.Popen[str], progress: ProgressView, what: str, log: Path) -> dict[str, Any]:
    """Follow a child's JSON lines (forwarding progress) until it reports a result, an error or exits."""
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "progress" in message:
            p = message["progress"]
            if p["event"] == "start":
                progress.start(p["label"], p["total"])
            elif p["event"] == "update":
                progress.update(p["label"], p["completed"])
            else:
                progress.finish(p["label"])
        elif "error" in message:
            proc.wait()
            if message.get("verify"):
                raise VerifyError(message["error"])
            raise BenchError(f"{message['error']} ({what}'s log: {last_line(log)})")
        elif "result" in message or "ready" in message:
            return message
    code = proc.wait()
    raise BenchError(f"{what} exited with code {code} before reporting: {last_line(log)}")


def run_mooncake(folder: Path, spec: Spec, progress: ProgressView) -> dict[str, Any]:
    """mooncake_master (HTTP metadata server built in), one store-server process, and a client process."""
    # the segment holds everything the run stores, far below the master's eviction watermark (0.9)
    segment = (spec.max_bytes * 13 // 10 + (256 << 20)) >> 20 << 20
    procs: list[subprocess.Popen[Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvbench-mooncake-") as tmp:
        try:
            for attempt in (1, 2):  # a second try, on fresh ports, when another process took one meanwhile
                logs = Path(tmp) / f"try-{attempt}"
                logs.mkdir()
                try:
                    params = _start_mooncake_services(folder, segment, spec, logs, procs, progress)
                    break
                except BenchError:
                    _stop_all(procs)
                    if attempt == 2:
                        raise
            client = _child("_mooncake_client_main", params, logs / "client.log")
            procs.append(client)
            result = _read_messages(client, progress, "the Mooncake client", logs / "client.log")["result"]
        finally:
            _stop_all(procs)
    result["version"] = _mooncake_version()
    return with_raw(result, raw_stream_gbps(result["put"]["bytes"]))


def _start_mooncake_services(
    folder: Path, segment: int, spec: Spec, logs: Path, procs: list[subprocess.Popen[Any]], progress: ProgressView
) -> dict[str, Any]:
    """Start mooncake_master and the store server (appended to ``procs``); returns the client's parameters."""
    rpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    master_cmd = [
        str(folder / "mooncake_master"),
        f"--rpc_port={rpc_port}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http_port}",
        f"--metrics_port={metrics_port}",
    ]
    with open(logs / "master.log", "ab") as err:
        master = subprocess.Popen(
            master_cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, preexec_fn=die_with_parent
        )
    procs.append(master)
    wait_port(rpc_port, master, "mooncake_master", logs / "master.log")
    wait_port(http_port, master, "mooncake_master's HTTP metadata server", logs / "master.log")
    params = {
        "metadata": f"http://127.0.0.1:{http_port}/metadata",
        "master": f"127.0.0.1:{rpc_port}",
        "segment": segment,
        "spec": spec.to_dict(),
    }
    server = _child("_mooncake_store_server_main", params, logs / "server.log")
    procs.append(server)
    _read_messages(server, progress, "the Mooncake store server", logs / "server.log")
    return params


def _stop_all(procs: list[subprocess.Popen[Any]]) -> None:
    while procs:
        proc = procs.pop()
        stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def _mooncake_setup(params: dict[str, Any], segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", params["metadata"], segment, 16 << 20, "tcp", "", params["master"])
    if rc != 0:
        raise BenchError(f"mooncake setup returned {rc}")
    return store


def _mooncake_store_server_main(params_json: str) -> int:
    """Child process: hold the store's segment until SIGTERM."""
    params = json.loads(params_json)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        store = _mooncake_setup(params, params["segment"])
    except Exception as exc:
        print(json.dumps({"error": f"Mooncake store server: {exc}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    store.close()
    return 0


def _mooncake_client_main(params_json: str) -> int:
    """Child process: the Mooncake run (same phases as kvtier's), reported as JSON lines on stdout."""
    params = json.loads(params_json)
    spec = Spec.from_dict(params["spec"])
    try:
        store = _mooncake_setup(params, 0)
        lock = threading.Lock()
        sessions = [MooncakeSession(store, lock) for _ in range(spec.concurrency)]
        try:
            result, _ = run_putget("mooncake", sessions, spec, JsonLinesProgress())
        finally:
            for s in sessions:
                s.close()
        store.close()
    except BenchError as exc:
        print(json.dumps({"error": str(exc), "verify": isinstance(exc, VerifyError)}), flush=True)
        return 1
    print(json.dumps({"result": result}), flush=True)
    return 0
