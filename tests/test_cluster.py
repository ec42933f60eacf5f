"""The cluster file: what ``kvstore init`` writes loads back as written, and ``cluster.config.edit`` keeps what it does
not change."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.config import ConfigError


def test_a_host_with_a_quote_and_a_backslash_round_trips(tmp_path: Path) -> None:
    host = 'rack "7"\\b'
    path = cluster_mod.write_default(tmp_path, host=host, base_port=7400)
    config = cluster_mod.load(path)
    assert {node.host for node in config.nodes.values()} == {host}
    assert [node.port for node in config.nodes.values()] == list(range(7400, 7412))


def test_init_never_overwrites_a_cluster_file(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    before = path.read_text()
    with pytest.raises(ConfigError, match="already exists"):
        cluster_mod.write_default(tmp_path, base_port=7500)
    assert path.read_text() == before


def test_edit_changes_one_value_and_keeps_comments_and_order(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    text = path.read_text().replace("[gc]\n", "# tuned for the test rack\n[gc]  # fractions of capacity\n")
    text = text.replace("low_watermark = 0.8\n", "low_watermark = 0.8  # keep headroom\n")
    path.write_text(text)
    with cluster_mod.edit(path) as doc:
        doc["gc"]["low_watermark"] = 0.7
    assert path.read_text() == text.replace("low_watermark = 0.8  #", "low_watermark = 0.7  #")
    assert cluster_mod.load(path).gc.low_watermark == 0.7


def test_an_edit_that_breaks_the_file_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    before = path.read_text()
    with pytest.raises(ConfigError, match="watermarks"), cluster_mod.edit(path) as doc:
        doc["gc"]["low_watermark"] = 0.95
    assert path.read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("port = 7400\n", "port = 7400.5\n", "nodes[0].port: expected `int`, got `float`"),
        ("id = 0\n", 'id = "zero"\n', "nodes[0].id: expected `int`, got `str`"),
        ("id = 0\n", "id = 65536\n", "node id 65536 is out of range: ids are 0 to 65535"),
        ('host = "127.0.0.1"\n', "host = 5\n", "nodes[0].host: expected `str`, got `int`"),
        ("metrics_port = 7412\n", "metric_port = 7412\n", "nodes[0]: object contains unknown field `metric_port`"),
        ('capacity = "2GiB"\n', "", "nodes[0]: object missing required field `capacity`"),
        ('capacity = "2GiB"\n', 'capacity = "lots"\n', "node 0: capacity: bad size 'lots'"),
        ('agent = "3d"', "agent = true", "ttl.agent: expected `int | float | str`, got `bool`"),
        ('agent = "3d"', 'agent = "soon"', "ttl.agent: bad duration 'soon'"),
        ("[gc]\n", '[gc]\ninterval_s = "soon"\n', "gc.interval_s: bad duration 'soon'"),
        ("[gc]\n", "[gc]\ninterval_s = true\n", "gc.interval_s: expected `float`, got `bool`"),
        ("[gc]\n", "[gc]\ninterval = 5\n", "[gc] has unknown keys: interval"),
        ("[gc]\n", "[gc]\nmeta_sync_s = 0\n", "[gc] meta_sync_s and access_flush_s must be positive"),
        ("[gc]\n", "[gc]\nmax_disk_fraction = 1.5\n", "[gc] max_disk_fraction must be above 0 and at most 1"),
        ("[gc]\n", "[gc]\nmax_headroom_bytes = -1\n", "[gc] max_headroom_bytes must be 0 or more"),
        ("[gc]\n", '[gc]\nmax_headroom_bytes = "lots"\n', "gc.max_headroom_bytes: bad size 'lots'"),
        ("[gc]\n", "[limits]\nmax_batch = 1.5\n\n[gc]\n", "limits.max_batch: expected `int`, got `float`"),
        ("[gc]\n", "[limits]\nmax_batch = 65537\n\n[gc]\n", "limits.max_batch cannot exceed 65536"),
        ("[gc]\n", '[tenants.teamb]\ntoken = "short"\n\n[gc]\n', "tenants.teamb.token must be at least 32"),
        ("nodes = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]", "nodes = [0, 1]", "groups[0] has 2 nodes"),
        ("[cluster]", "[klaster]", "object missing required field `cluster`"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path: Path, old: str, new: str, message: str) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as caught:
        cluster_mod.load(path)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_tables_of_other_programs_are_left_to_them(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, base_port=7400)
    path.write_text(path.read_text() + "\n[fetcher]\nslots = 4\n")
    assert len(cluster_mod.load(path).nodes) == 12
