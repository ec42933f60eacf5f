"""The cluster file: what ``kvstore init`` writes loads back as written, and ``cluster.edit`` keeps what it does
not change."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.kvstore import cluster as cluster_mod
from kvtier.kvstore.cluster import ConfigError


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
