"""Secrets on disk: the cluster file holds every token, so it is written 0600 and every process refuses one that
group or others may open; client hosts get the token-free client file and a tenant token of their own
(``--token-file``, ``$KVTIER_TOKEN``), never the admin's file."""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvtier.kvstore.client import connect
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.config import ConfigError
from kvtier.kvstore.wire.transport import AuthError
from kvtier.transfer.fetch_client import FetchClient
from kvtier.transfer.fetcher import LocalFetcher

BIN = Path(sys.executable).parent  # the environment's console scripts: kvstore, kvctl, kvtier-*, kvbench
TEAMB = secrets.token_hex(16)
BLOCK = 64 << 10


def run(*argv: object, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=env)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single line a refused command prints; fails when it printed a traceback or several lines."""
    err = done.stderr.strip()
    assert done.returncode != 0 and err, done
    assert "\n" not in err and "Traceback" not in err, err
    return err


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def token_file(path: Path, token: str, file_mode: int = 0o600) -> Path:
    path.write_text(token + "\n")
    path.chmod(file_mode)
    return path


@pytest.fixture
def open_cluster_file(tmp_path: Path) -> Path:
    """A cluster file that others may read (as the files `kvstore init` wrote before it made them 0600)."""
    path = cluster_mod.write_default(tmp_path / "c", base_port=7400)
    path.chmod(0o644)
    return path


# -- writing and loading the files -----------------------------------------------------------------------------


def test_kvstore_init_writes_the_cluster_file_0600_and_a_token_free_client_file(tmp_path: Path) -> None:
    done = run(BIN / "kvstore", "init", tmp_path / "c", "--base-port", "7400")
    assert done.returncode == 0, done.stderr
    path, public = tmp_path / "c" / "cluster.toml", tmp_path / "c" / "cluster.public.toml"
    assert mode(path) == 0o600
    assert mode(public) == 0o644 and str(public) in done.stdout
    doc = tomllib.loads(public.read_text())
    assert "token" not in doc["cluster"] and "tenants" not in doc
    assert cluster_mod.load(path).token not in public.read_text()
    assert cluster_mod.load_client(public, TEAMB).nodes == cluster_mod.load(path).nodes


@pytest.mark.parametrize("file_mode", [0o640, 0o604, 0o660, 0o620])
def test_a_cluster_file_group_or_others_may_open_is_refused_in_one_line(tmp_path: Path, file_mode: int) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    path.chmod(file_mode)
    for load in (cluster_mod.load, cluster_mod.load_client):
        with pytest.raises(ConfigError, match=f"run `chmod 600 {path}`"):
            load(path)
    path.chmod(0o400)
    assert cluster_mod.load(path).token


def test_the_client_file_may_be_world_readable_but_needs_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public = cluster_mod.public_path(cluster_mod.write_default(tmp_path, base_port=7400))
    monkeypatch.delenv(cluster_mod.TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match="--token-file PATH or \\$KVTIER_TOKEN"):
        cluster_mod.load_client(public)
    with pytest.raises(ConfigError, match="nodes and the directory need the cluster file"):
        cluster_mod.load(public)
    monkeypatch.setenv(cluster_mod.TOKEN_ENV, TEAMB)
    config = cluster_mod.load_client(public)
    assert config.token == TEAMB and config.tenants == {cluster_mod.TOKEN_TENANT: TEAMB}


def test_a_token_file_others_may_open_is_refused(tmp_path: Path) -> None:
    path = token_file(tmp_path / "teamb.token", TEAMB, 0o644)
    with pytest.raises(ConfigError, match=f"run `chmod 600 {path}`"):
        cluster_mod.read_token_file(path)
    path.chmod(0o600)
    assert cluster_mod.read_token_file(path) == TEAMB


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[tenants."tеamb"]\ntoken = "' + "t" * 40 + '"\n', "only hold ASCII letters, digits, - and _"),  # Cyrillic е
        ('[tenants."team b"]\ntoken = "' + "t" * 40 + '"\n', "[A-Za-z0-9_-]"),
        ('[tenants.teamb]\ntoken = "' + "t" * 16 + '"\n', "tenants.teamb.token must be at least 32"),
        ('[tenants.teamb]\ntoken = "' + "t " * 20 + '"\n', "without spaces"),
    ],
)
def test_tenant_names_are_ascii_and_tokens_long(tmp_path: Path, table: str, message: str) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    path.write_text(path.read_text() + "\n" + table)
    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("]", "\\]")):
        cluster_mod.load(path)


def test_a_short_cluster_token_is_refused(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    path.write_text(path.read_text().replace(cluster_mod.load(path).token, "s" * 20))
    with pytest.raises(ConfigError, match=r"cluster\.token must be at least 32"):
        cluster_mod.load(path)


def test_an_edit_keeps_the_file_0600_and_the_client_file_in_step(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    with cluster_mod.edit(path) as doc:
        doc["ttl"]["agent"] = "12h"
    assert mode(path) == 0o600
    assert cluster_mod.load_client(cluster_mod.public_path(path), TEAMB).ttl_classes["agent"] == 12 * 3600


def test_kvctl_tenant_add_writes_a_new_token_to_a_0600_file(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    out = tmp_path / "teamb.token"
    done = run(BIN / "kvctl", "--config", path, "tenant", "add", "teamb", "--token-out", out)
    assert done.returncode == 0, done.stderr
    token = cluster_mod.read_token_file(out)
    assert mode(out) == 0o600 and mode(path) == 0o600 and token not in done.stdout
    assert cluster_mod.load(path).tenants["teamb"] == token and len(token) >= 64
    assert "teamb" not in cluster_mod.public_path(path).read_text()
    again = run(BIN / "kvctl", "--config", path, "tenant", "add", "teamb", "--token-out", tmp_path / "other")
    assert "exists already" in one_line(again) and not (tmp_path / "other").exists()


def test_kvctl_export_client_writes_the_cluster_file_without_its_tokens(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path / "c", base_port=7400)
    out = tmp_path / "for-client-hosts.toml"
    done = run(BIN / "kvctl", "--config", path, "export-client", "--out", out)
    assert done.returncode == 0, done.stderr
    assert mode(out) == 0o644 and cluster_mod.load(path).token not in out.read_text()
    assert cluster_mod.load_client(out, TEAMB).groups == cluster_mod.load(path).groups


# -- every process refuses an open cluster file ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["kvstore", "serve", "{config}"],
        [sys.executable, "-m", "kvtier.gc.nodeproc", "{config}", "0"],
        ["kvctl", "--config", "{config}", "status"],
        ["kvtier-fetcher", "--config", "{config}", "--socket", "{tmp}/f.sock", "--shm", "kvt-test-{tmp.name}"],
        ["kvtier-directory", "--config", "{config}", "--listen", "127.0.0.1:0"],
        ["kvtier-engine", "prefill", "--checkpoint", "{checkpoint}", "--store", "{config}"],
        ["kvbench", "--config", "{config}", "replay", "{tmp}/trace.jsonl", "--mode", "live"],
    ],
    ids=["kvstore-serve", "node", "kvctl", "fetcher", "directory", "engine", "kvbench"],
)
def test_every_process_refuses_a_cluster_file_others_may_open(
    open_cluster_file: Path, tmp_path: Path, checkpoint: Path, argv: list[str]
) -> None:
    command = [a.format(config=open_cluster_file, tmp=tmp_path, checkpoint=checkpoint) for a in argv]
    if not Path(command[0]).is_absolute():
        command[0] = str(BIN / command[0])
    assert f"run `chmod 600 {open_cluster_file}`" in one_line(run(*command))


# -- a running cluster: the port in use, and clients that hold only the client file and their token ------------


def port_taken_among_free_ones(before: int, after: int) -> socket.socket:
    """A listening socket whose port has ``before`` free ports below it and ``after`` above (checked, not reserved)."""
    for _ in range(100):
        taken = socket.create_server(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        try:
            for other in [*range(port - before, port), *range(port + 1, port + after + 1)]:
                socket.create_server(("127.0.0.1", other)).close()
        except OSError:
            taken.close()
            continue
        return taken
    raise RuntimeError("no run of free loopback ports")


def test_kvstore_serve_on_a_port_in_use_names_the_node_the_address_and_the_cause(tmp_path: Path) -> None:
    with port_taken_among_free_ones(3, 8) as taken:
        port = taken.getsockname()[1]
        path = cluster_mod.write_default(tmp_path, base_port=port - 3, metrics=False)
        err = one_line(run(BIN / "kvstore", "serve", path))
    assert f"node 3 cannot listen on 127.0.0.1:{port}" in err and "Address already in use" in err
    assert 'File "' not in err


@pytest.fixture(scope="module")
def tenant_cluster(make_cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A running cluster with tenant teamb: (cluster file, client file, teamb's token file)."""
    local = make_cluster(capacity_bytes=64 << 20, extra_toml=f'[tenants.teamb]\ntoken = "{TEAMB}"')
    public = cluster_mod.write_public(local.config_path)
    return local.config_path, public, token_file(tmp_path_factory.mktemp("tok") / "teamb.token", TEAMB)


def stored_as_teamb(public: Path, n: int = 4) -> tuple[list[bytes], list[bytes]]:
    keys = [secrets.token_bytes(16) for _ in range(n)]
    blocks = [np.random.default_rng(i).bytes(BLOCK) for i in range(n)]
    with connect(public, token=TEAMB) as kv:
        assert all(kv.put(keys, blocks))
    return keys, blocks


def test_a_client_with_the_client_file_and_a_tenant_token_is_that_tenant(tenant_cluster) -> None:
    config, public, _ = tenant_cluster
    keys, _ = stored_as_teamb(public)
    with connect(config) as admin:  # tenant "default": teamb's blocks are not there for it
        assert admin.get(keys) == [None] * len(keys)
    code = (
        "import sys; from kvtier.kvstore.client import connect\n"
        f"with connect({str(public)!r}) as kv: print(sum(b is not None for b in kv.get([bytes.fromhex(k) for k in "
        "sys.argv[1:]])))\n"
    )
    env = {**os.environ, cluster_mod.TOKEN_ENV: TEAMB}
    done = run(sys.executable, "-c", code, *(k.hex() for k in keys), env=env)
    assert done.stdout.strip() == str(len(keys)), done.stderr


def test_a_fetcher_given_the_client_file_serves_its_tenant_only(tenant_cluster, tmp_path: Path) -> None:
    config, public, tok = tenant_cluster
    keys, blocks = stored_as_teamb(public)
    extra = ["--token-file", str(tok)]
    with LocalFetcher(public, f"kvt-test-{secrets.token_hex(4)}", tmp_path / "f.sock", "8MiB", "64KiB", 1, extra) as f:
        with FetchClient(f.socket_path, TEAMB) as client, client.fetch(keys, BLOCK) as got:
            assert [bytes(b.array()) for b in got] == blocks
        with pytest.raises(AuthError):
            FetchClient(f.socket_path, cluster_mod.load(config).token).stats()


def test_a_fetcher_creates_a_missing_socket_folder_0700(tenant_cluster, tmp_path: Path) -> None:
    config, _, _ = tenant_cluster
    sock = tmp_path / "run" / "kvtier" / "fetch.sock"
    argv = ["--config", config, "--socket", sock, "--shm", f"kvt-test-{secrets.token_hex(4)}", "--size", "8MiB"]
    fetcher = subprocess.Popen([str(a) for a in (BIN / "kvtier-fetcher", *argv)], stdout=subprocess.PIPE, text=True)
    try:
        assert fetcher.stdout is not None and fetcher.stdout.readline().split()[0] == "ready"
        assert sock.exists() and mode(sock.parent) == 0o700
    finally:
        fetcher.terminate()
        fetcher.wait(30)


def test_a_fetcher_names_a_socket_folder_it_cannot_make(tenant_cluster, tmp_path: Path) -> None:
    config, _, _ = tenant_cluster
    (tmp_path / "run").write_text("a file where the folder should be")
    argv = ["--config", config, "--socket", tmp_path / "run" / "fetch.sock", "--shm", "kvt-test-none"]
    assert f"cannot create the socket's folder {tmp_path / 'run'}" in one_line(run(BIN / "kvtier-fetcher", *argv))


def test_an_engine_worker_runs_on_the_client_file_and_a_token_file(tenant_cluster, checkpoint: Path) -> None:
    from kvtier.engine.worker import WorkerProcess

    _, public, tok = tenant_cluster
    worker = WorkerProcess.engine("prefill", "--checkpoint", str(checkpoint), "--store", str(public), "--token-file",
                                  str(tok)).wait_ready()  # fmt: skip
    try:
        prompt = np.random.default_rng(5).integers(0, 256, 300).tolist()
        first, second = worker.ask({"id": 1, "prompt": prompt}), worker.ask({"id": 2, "prompt": prompt})
    finally:
        worker.stop()
    assert "error" not in first and first["hit_tokens"] == 0
    assert second["hit_tokens"] > 0  # its own blocks, stored as teamb, reused


def test_kvbench_runs_on_the_client_file_and_a_token_file(tenant_cluster) -> None:
    _, public, tok = tenant_cluster
    argv = ["--config", public, "--token-file", tok, "putget", "--block-size", "64KiB", "--duration", "1", "--json"]
    done = run(BIN / "kvbench", *argv)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kvtier"]
