"""What the adapters share (``kvtier.adapters.store``): settings, the keyspace, raw views, and store calls."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.adapters.store import AdapterStore, Keyspace, SettingsError, StoreSettings, pointer_views
from kvtier.kvstore.cluster.local import LocalCluster


def test_keys_are_stable_across_processes_and_apart_across_deployments() -> None:
    code = "from kvtier.adapters.store import Keyspace; print(Keyspace({'model': 'm'}).keys(['p'], (0, 1))[0][1].hex())"
    here = Keyspace({"model": "m"}).keys(["p"], (0, 1))
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == here[0][1].hex()
    keys, headers = here
    assert [len(k) for k in keys] == [16, 16] and [len(h) for h in headers] == [16, 16] and keys[0] != keys[1]
    assert (
        Keyspace({"model": "m", "tp": [1, 2]}).keys(["p"])[0] != Keyspace({"model": "m", "tp": [0, 2]}).keys(["p"])[0]
    )
    assert Keyspace({"b": 1, "a": 2}).digest == Keyspace({"a": 2, "b": 1}).digest  # canonical: order does not matter


def test_settings_refuse_what_cannot_work_in_one_line(tmp_path: Path) -> None:
    cases = [
        ({}, "'config'"),
        ({"config": "c.toml", "token": "a", "token_file": "b"}, "not both"),
        ({"config": "c.toml", "token_file": str(tmp_path / "absent")}, "cannot read token file"),
        ({"config": "c.toml", "timeout_s": "5"}, "timeout_s"),
        ({"config": "c.toml", "timeout_s": True}, "timeout_s"),
        ({"config": "c.toml", "namespace": 3}, "namespace"),
    ]
    for values, what in cases:
        with pytest.raises(SettingsError, match=what) as err:
            StoreSettings.from_mapping(values, "where")
        assert str(err.value).startswith("where: ") and "\n" not in str(err.value)


def test_a_kv_format_setting_is_refused_in_one_line_naming_the_engines_own() -> None:
    # the adapters store the host engine's pages as they are (docs/adapters.md, "KV formats"): a kvtier KV format
    # there would be ignored, the pages staying in the engine's dtype while the deployment believes them encoded
    with pytest.raises(SettingsError, match="kv-cache-dtype") as err:
        StoreSettings.from_mapping({"config": "c.toml", "kv_format": "fp8-e4m3"}, "where")
    assert str(err.value).startswith("where: 'kv_format'") and "\n" not in str(err.value)


def test_a_token_file_keeps_the_token_off_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "token").chmod(0o600)
    assert (
        StoreSettings.from_mapping({"config": "c.toml", "token_file": str(tmp_path / "token")}, "w").token == "s3cret"
    )


def test_pointer_views_are_the_memory_itself() -> None:
    memory = (ctypes.c_char * 8)()
    (view,) = pointer_views([ctypes.addressof(memory)], [8])
    view[2:4] = b"xy"
    assert memory.raw[2:4] == b"xy" and len(view) == 8 and not view.readonly


@pytest.fixture(scope="module")
def cluster(make_cluster) -> LocalCluster:
    return make_cluster(capacity_bytes=32 << 20)


def test_blocks_already_stored_are_not_sent_again(cluster: LocalCluster) -> None:
    store = AdapterStore(StoreSettings(cluster.config_path), "test")
    keys, headers = Keyspace({"model": "m"}).keys(["a", "b"])
    assert store.put(keys[:1], headers[:1], [bytes(4096)]) == [True]
    client = store.client()
    sent: list[int] = []
    put_from = client.put_from
    client.put_from = lambda k, *a, **kw: sent.append(len(k)) or put_from(k, *a, **kw)
    assert store.put(keys, headers, [bytes(4096), b"\1" * 4096]) == [True, True]
    assert sent == [1]
    got = [bytearray(4096), bytearray(4096)]
    assert store.get_into(keys, headers, got) == [True, True] and got[1] == b"\1" * 4096
    store.close()


def test_a_reader_of_another_keyspace_misses_even_with_the_same_kvtier_key(cluster: LocalCluster) -> None:
    """The header digest, not only the key, decides: a collision of kvtier keys is a miss, never other bytes."""
    store = AdapterStore(StoreSettings(cluster.config_path), "test")
    keys, headers = Keyspace({"model": "m"}).keys(["collide"])
    assert store.put(keys, headers, [b"\7" * 1024]) == [True]
    _, other_headers = Keyspace({"model": "other"}).keys(["collide"])
    assert store.get_into(keys, other_headers, [bytearray(1024)]) == [False]
    assert store.client().stats["header_mismatches"] == 1
    store.close()
