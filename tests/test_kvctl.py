"""kvctl, driven as an operator would: ``python -m kvtier.tools.kvctl`` against one real 12-node local cluster.

The cluster file gets two extra TTL classes at start (``shortlived``, ``evictable``) for the tests that change
or evict a class wholesale, so the blocks other tests rely on (class ``chatbot``) are never touched by them.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.kvstore import connect
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.codec import default_codec
from kvtier.kvstore.keys import Namespace, chain

from .conftest import wait_for

CAPACITY = 64 << 20
GC = "interval_s = 0.2\ngrace_s = 0.1\n"
TENANT_TOKEN = "teamb-token-" + "7" * 20
BLOCK = 40_000
NS = Namespace(model_id="kvctl-model", kv_dtype="bf16", block_tokens=16, layout="paged")
STORED_BLOCKS = 5  # of the 8 full blocks of the token prompt


@pytest.fixture(scope="module")
def cluster(make_cluster) -> Path:
    local = make_cluster(capacity_bytes=CAPACITY, gc=GC, extra_toml=f'[tenants.teamb]\ntoken = "{TENANT_TOKEN}"')
    path = local.config_path
    path.write_text(path.read_text().replace("[ttl]\n", '[ttl]\nshortlived = "1h"\nevictable = "1h"\n', 1))
    with connect(path) as kv:
        replies = kv.admin("ttl_set", classes=cluster_mod.load(path).ttl_classes)
    assert len(replies) == 12 and all("error" not in r for r in replies.values()), replies
    return path


@pytest.fixture(scope="module")
def stored(cluster: Path) -> dict:
    """A prompt of 8 full blocks (+5 tokens) whose first 5 blocks are stored, class chatbot."""
    tokens = np.random.default_rng(7).integers(0, 32000, 16 * 8 + 5)
    keys = chain(NS, tokens)
    with connect(cluster) as kv:
        assert kv.put(
            keys[:STORED_BLOCKS], [os.urandom(BLOCK) for _ in range(STORED_BLOCKS)], tokens=tokens, namespace=NS
        )
    return {"tokens": tokens, "keys": keys}


def kvctl(path: Path | None, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """``kvctl --config PATH ARGS`` presenting ``token`` in ``$KVTIER_TOKEN`` (never on the command line)."""
    cmd = [sys.executable, "-m", "kvtier.tools.kvctl"]
    if path is not None:
        cmd += ["--config", str(path)]
    env = {k: v for k, v in os.environ.items() if k not in ("KVTIER_CONFIG", "KVTIER_TOKEN", "COLUMNS")}
    if token is not None:
        env["KVTIER_TOKEN"] = token
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60, env=env)


def ok(path: Path, *args: str) -> str:
    result = kvctl(path, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def ok_json(path: Path, *args: str) -> dict:
    return json.loads(ok(path, "--json", *args))


def fails(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one stderr line of a failed command, after checking its exit status and that nothing else came."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvctl: "), result.stderr
    return lines[0]


def node_ttls(path: Path) -> list[dict]:
    """Every node's TTL table (all 12 answer)."""
    with connect(path) as kv:
        ttls = [info["ttl"] for info in kv.node_info().values()]
    assert len(ttls) == 12
    return ttls


# --- status, nodes ----------------------------------------------------------------------------------------------


def test_status_table_shows_nodes_capacity_blocks_codec_and_ttl(cluster: Path, stored: dict) -> None:
    out = ok(cluster, "status")
    assert "12 up, 0 down of 12" in out
    assert "768.0 MiB" in out  # 12 × 64 MiB
    assert "high 90%, low 80%" in out
    assert default_codec().backend in out
    assert "chatbot = 7d" in out and "agent = 3d" in out


def test_status_json_has_counts_usage_watermarks_codec_and_ttl(cluster: Path, stored: dict) -> None:
    status = ok_json(cluster, "status")
    assert status["nodes"]["up"] == 12 and status["nodes"]["down"] == []
    assert status["capacity_bytes"] == 12 * CAPACITY
    assert 0 < status["used_bytes"] < status["capacity_bytes"]
    assert status["watermarks"] == {"high": 0.9, "low": 0.8}
    assert status["blocks_by_class"]["chatbot"] >= STORED_BLOCKS
    assert status["blocks"] == sum(status["blocks_by_class"].values())
    assert status["codec_backend"] == default_codec().backend
    assert status["ttl"]["chatbot"] == 7 * 86400


def test_nodes_table_lists_every_node_with_address_and_state(cluster: Path, stored: dict) -> None:
    out = ok(cluster, "nodes")
    config = cluster_mod.load(cluster)
    for nid, node in config.nodes.items():
        line = next(ln for ln in out.splitlines() if f"{node.host}:{node.port}" in ln)
        assert line.split()[0] == str(nid) and " up " in line and "64.0 MiB" in line


def test_nodes_json_has_usage_shards_primary_blocks_and_gc_state(cluster: Path, stored: dict) -> None:
    rows = ok_json(cluster, "nodes")["nodes"]
    assert [r["id"] for r in rows] == list(range(12))
    assert all(r["state"] == "up" and r["capacity_bytes"] == CAPACITY for r in rows)
    assert all(r["shards"] >= STORED_BLOCKS and r["used_bytes"] > 0 for r in rows)  # one shard of each block
    assert sum(r["blocks"] for r in rows) >= STORED_BLOCKS  # primaries only: each block counted once
    assert all(r["gc"]["cycles"] > 0 and r["gc"]["last_error"] == "" for r in rows)
    assert all({"evictions", "expirations"} <= set(r["gc"]) for r in rows)


# --- stat, match ------------------------------------------------------------------------------------------------


def test_stat_of_a_stored_key_shows_its_12_shards(cluster: Path, stored: dict) -> None:
    key = stored["keys"][0].hex()
    info = ok_json(cluster, "stat", key)
    assert info["committed_shards"] == 12
    assert [s["index"] for s in info["shards"]] == list(range(12))
    assert len({s["node"] for s in info["shards"]}) == 12
    assert all(s["state"] == "committed" and s["length"] == BLOCK // 10 for s in info["shards"])
    assert info["block"]["block_len"] == BLOCK and info["block"]["ttl_class"] == "chatbot" and info["block"]["live"]
    out = ok(cluster, "stat", key)
    assert "12/12 committed" in out and "chatbot (live)" in out and "ago)" in out and "(in 6d" in out


def test_match_on_a_npy_token_file_gives_the_hit_length(cluster: Path, stored: dict, tmp_path: Path) -> None:
    np.save(tmp_path / "prompt.npy", stored["tokens"])
    args = ["--model", NS.model_id, "--dtype", NS.kv_dtype, "--block-tokens", "16", "--layout", NS.layout]
    out = ok(cluster, "match", "--tokens", str(tmp_path / "prompt.npy"), *args)
    assert f"hit {STORED_BLOCKS} of 8 blocks = {STORED_BLOCKS * 16} of {16 * 8 + 5} tokens" in out


def test_match_on_a_text_token_file_gives_the_hit_length(cluster: Path, stored: dict, tmp_path: Path) -> None:
    (tmp_path / "prompt.txt").write_text("\n".join(str(t) for t in stored["tokens"][: 16 * 3 + 2]) + "\n")
    args = ["--model", NS.model_id, "--dtype", NS.kv_dtype, "--block-tokens", "16", "--layout", NS.layout]
    found = ok_json(cluster, "match", "--tokens", str(tmp_path / "prompt.txt"), *args)
    assert (found["blocks"], found["hit_blocks"], found["hit_tokens"]) == (3, 3, 48)
    other = ok_json(cluster, "match", "--tokens", str(tmp_path / "prompt.txt"), *args[:-1], "contiguous")
    assert other["hit_blocks"] == 0  # another namespace: other keys


# --- ttl --------------------------------------------------------------------------------------------------------


def test_ttl_set_changes_show_the_file_the_nodes_and_expires_stored_blocks(cluster: Path) -> None:
    key = os.urandom(16)
    with connect(cluster) as kv:
        assert kv.put([key], [os.urandom(BLOCK)], ttl_class="shortlived") == [True]
        before = cluster.read_text().splitlines()
        ok(cluster, "ttl", "set", "shortlived", "1s")
        show = ok_json(cluster, "ttl", "show")
        assert show["ttl"]["shortlived"] == 1.0 and show["ttl_human"]["shortlived"] == "1s"
        assert show["nodes_out_of_sync"] == {}
        line = next(ln for ln in ok(cluster, "ttl", "show").splitlines() if "shortlived" in ln)
        assert line.split()[:2] == ["shortlived", "1s"]
        after = cluster.read_text().splitlines()
        changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
        assert changed == [('shortlived = "1h"', 'shortlived = "1s"')]
        assert all(ttl["shortlived"] == 1.0 for ttl in node_ttls(cluster))
        wait_for(lambda: kv.exists([key]) == [False], 10, "the block to expire under its new 1 s TTL")


def test_ttl_set_keeps_the_files_comments_and_order(cluster: Path) -> None:
    original = cluster.read_text()
    commented = original.replace("[ttl]\n", "# ask ops before changing these\n[ttl]  # 30s, 12h, 3d\n", 1)
    commented = commented.replace('evictable = "1h"\n', 'evictable = "1h"   # used by the evict test\n', 1)
    cluster.write_text(commented)
    try:
        ok(cluster, "ttl", "set", "evictable", "2h")
        assert cluster.read_text() == commented.replace('evictable = "1h"   #', 'evictable = "2h"   #')
    finally:
        ok(cluster, "ttl", "set", "evictable", "1h")
        cluster.write_text(original)


def test_ttl_set_keeps_the_cluster_file_private_and_its_client_file_in_step(cluster: Path) -> None:
    public = cluster_mod.write_public(cluster)
    try:
        ok(cluster, "ttl", "set", "evictable", "2h")
        assert stat.S_IMODE(cluster.stat().st_mode) == 0o600
        assert cluster_mod.load_client(public, TENANT_TOKEN).ttl_classes["evictable"] == 2 * 3600
    finally:
        ok(cluster, "ttl", "set", "evictable", "1h")
        public.unlink()


def test_ttl_add_then_remove_of_an_unused_class(cluster: Path) -> None:
    original = cluster.read_text()
    ok(cluster, "ttl", "add", "weekly", "7d")
    assert ok_json(cluster, "ttl", "show")["ttl"]["weekly"] == 7 * 86400
    assert 'weekly = "7d"' in cluster.read_text()
    assert all(ttl["weekly"] == 7 * 86400 for ttl in node_ttls(cluster))
    ok(cluster, "ttl", "remove", "weekly")
    assert "weekly" not in ok_json(cluster, "ttl", "show")["ttl"]
    assert cluster.read_text() == original  # every other line kept as it was
    assert all("weekly" not in ttl for ttl in node_ttls(cluster))


def test_ttl_remove_of_a_class_in_use_is_refused(cluster: Path, stored: dict) -> None:
    original = cluster.read_text()
    line = fails(kvctl(cluster, "ttl", "remove", "chatbot"), 1)
    assert "refused" in line and "chatbot" in line and "evict" in line
    assert cluster.read_text() == original
    assert all("chatbot" in ttl for ttl in node_ttls(cluster))


# --- evict, gc, repair, drain -----------------------------------------------------------------------------------


def test_evict_dry_run_reports_without_removing_then_evict_removes(cluster: Path) -> None:
    keys = [os.urandom(16) for _ in range(4)]
    with connect(cluster) as kv:
        assert kv.put(keys, [os.urandom(BLOCK) for _ in keys], ttl_class="evictable") == [True] * 4
        dry = ok_json(cluster, "evict", "--class", "evictable", "--dry-run")
        assert (dry["matched"], dry["evicted"]) == (4, 0)
        assert kv.exists(keys) == [True] * 4
        done = ok_json(cluster, "evict", "--class", "evictable")
        assert (done["matched"], done["evicted"]) == (4, 4)
        assert kv.exists(keys) == [False] * 4
    assert "0 blocks of class evictable would be evicted" in ok(cluster, "evict", "--class", "evictable", "--dry-run")


def test_gc_run_prints_per_node_stats(cluster: Path) -> None:
    out = ok(cluster, "gc", "run")
    assert "cycles" in out and "evictions" in out and "expirations" in out
    assert sum(1 for ln in out.splitlines() if ln.split() and ln.split()[0].isdigit()) == 12
    stats = ok_json(cluster, "gc", "run")["nodes"]
    assert sorted(map(int, stats)) == list(range(12)) and all(s["cycles"] > 0 for s in stats.values())


def test_repair_rewrites_the_shards_a_draining_node_did_not_take(cluster: Path) -> None:
    drained = 7
    keys = [os.urandom(16) for _ in range(24)]
    with connect(cluster) as kv:
        kv.admin("drain", [drained], on=True)
        try:
            stored = kv.put(keys, [os.urandom(BLOCK) for _ in keys])  # its primaries' blocks are refused
        finally:
            kv.admin("drain", [drained], on=False)
        keys = [k for k, s in zip(keys, stored, strict=True) if s]
        # the drained node took none of their shards; their primaries, owing the repairs, may have made some already
        assert keys and (kv.probe(keys).sum(axis=1) >= 11).all()
        repaired = ok_json(cluster, "repair")
        assert kv.probe(keys).all()
        # their primaries owe these repairs and may have made them already; either way each shard is written once
        assert 0 <= repaired["shards_repaired"] <= len(keys)
    assert "repair: 0 shards rewritten by 12 nodes" in ok(cluster, "repair")


def test_drain_marks_the_node_draining_and_undo_clears_it(cluster: Path) -> None:
    node = 4
    try:
        assert f"safe to stop node {node} now" in ok(cluster, "drain", str(node))
        states = [r["state"] for r in ok_json(cluster, "nodes")["nodes"]]
        assert states[node] == "draining" and states.count("up") == 11
        line = next(ln for ln in ok(cluster, "nodes").splitlines() if ln.split()[:1] == [str(node)])
        assert "draining" in line
        ok(cluster, "drain", str(node), "--undo")
        assert [r["state"] for r in ok_json(cluster, "nodes")["nodes"]] == ["up"] * 12
    finally:
        with connect(cluster) as kv:
            kv.admin("drain", [node], on=False)


def test_top_count_2_json_prints_2_snapshots(cluster: Path) -> None:
    lines = ok(cluster, "--json", "top", "--count", "2", "--interval", "0.2").splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert len(first["nodes"]) == 12 and first["totals"]["up"] == 12
    assert second["time"] > first["time"]
    assert all(r["ops_per_s"] is not None for r in second["nodes"])  # a rate needs two samples


def test_top_draws_a_table_of_nodes(cluster: Path) -> None:
    out = ok(cluster, "top", "--count", "1")
    assert "12 up, 0 down" in out and "ops/s" in out
    assert sum(1 for ln in out.splitlines() if ln.split()[1:2] == ["up"]) == 12


# --- errors: exit status and one line on stderr -----------------------------------------------------------------


def test_an_unknown_class_is_an_error(cluster: Path) -> None:
    assert "nosuch" in fails(kvctl(cluster, "ttl", "set", "nosuch", "3d"), 2)
    assert "nosuch" in fails(kvctl(cluster, "evict", "--class", "nosuch"), 2)
    assert "exists already" in fails(kvctl(cluster, "ttl", "add", "chatbot", "1d"), 2)


def test_a_bad_duration_is_an_error(cluster: Path) -> None:
    original = cluster.read_text()
    assert "3x" in fails(kvctl(cluster, "ttl", "set", "agent", "3x"), 2)
    assert "3x" in fails(kvctl(cluster, "evict", "--older-than", "3x"), 2)
    assert cluster.read_text() == original


def test_a_bad_key_hex_is_an_error(cluster: Path) -> None:
    assert "hex" in fails(kvctl(cluster, "stat", "not-hex"), 2)
    assert "32 hex digits" in fails(kvctl(cluster, "stat", "abcd"), 2)


def test_a_missing_or_invalid_cluster_file_is_an_error(tmp_path: Path) -> None:
    assert "does not exist" in fails(kvctl(tmp_path / "nope.toml", "status"), 2)
    (tmp_path / "bad.toml").write_text("[cluster\n")
    assert "not valid TOML" in fails(kvctl(tmp_path / "bad.toml", "status"), 2)
    assert "KVTIER_CONFIG" in fails(kvctl(None, "status"), 2)


def test_an_unreachable_cluster_is_an_error(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, capacity_bytes=CAPACITY)  # never started
    assert "no node" in fails(kvctl(path, "status"), 2)
    assert "no node" in fails(kvctl(path, "stat", "00" * 16), 2)


def test_a_tenant_token_on_an_admin_command_is_an_error(cluster: Path) -> None:
    original = cluster.read_text()
    for command in (["status"], ["nodes"], ["ttl", "set", "agent", "1d"], ["gc", "run"], ["drain", "3"]):
        assert "admin" in fails(kvctl(cluster, *command, token=TENANT_TOKEN), 2)
    assert cluster.read_text() == original
    assert all(ttl["agent"] == 3 * 86400 for ttl in node_ttls(cluster))


def test_a_token_on_the_command_line_is_refused_before_it_is_used(cluster: Path) -> None:
    """``kvctl --token T`` put the token in every user's ``ps``."""
    said = fails(kvctl(cluster, "--token", TENANT_TOKEN, "stat", "00" * 16), 2)
    assert "--token-file" in said and "ps" in said and TENANT_TOKEN not in said


def test_a_wrong_token_is_an_error(cluster: Path) -> None:
    assert "rejected" in fails(kvctl(cluster, "status", token="not-the-token-0123456789"), 2)
    assert "rejected" in fails(kvctl(cluster, "stat", "00" * 16, token="not-the-token-0123456789"), 2)
