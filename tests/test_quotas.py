"""Per-tenant quotas: shares of each primary's budget, eviction within the writer's tenant first, and no
eviction of anyone else's blocks for a write whose payload has not arrived.

The policy is pure and tested directly; the rest runs against real node processes, tenants writing through
their own tokens, and an attacker speaking the wire protocol by hand.
"""

from __future__ import annotations

import os
import secrets
import socket
import time

import numpy as np
import pytest

from kvtier.kvstore.client import Client
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.node.quotas import TenantShares, plan_removals
from kvtier.kvstore.placement import Placement
from kvtier.kvstore.wire.protocol import Op, encode_head

TOKEN_A, TOKEN_B = secrets.token_hex(16), secrets.token_hex(16)
CAPACITY = 8 << 20  # a primary's budget: 8 MiB / 12, about 97 blocks of 64 KiB (a 7 KiB slot on every node)
BLOCK = 64 << 10
PRIMARY = 3  # the primary every test fills
# only on-demand eviction (the watermark GC never starts): every eviction is one a write asked for; a write waits
# the default 2 s for evictions under way to free its slots (as tests/test_gc.py: 0.5 s refused writes under load)
ON_DEMAND_ONLY = "interval_s = 0.2\nhigh_watermark = 1.0\nlow_watermark = 0.99\nroom_wait_s = 2.0\n"


def tenants(quota_a: float | None = None, quota_b: float | None = None) -> str:
    def table(name: str, token: str, quota: float | None) -> str:
        return f'[tenants.{name}]\ntoken = "{token}"\n' + (f"quota = {quota}\n" if quota is not None else "")

    return table("a", TOKEN_A, quota_a) + table("b", TOKEN_B, quota_b)


def keys_at(local: LocalCluster, primary: int, n: int) -> list[bytes]:
    """``n`` random keys whose primary is ``primary``."""
    placement, keys = Placement(local.config.groups), []
    while len(keys) < n:
        candidates = [os.urandom(16) for _ in range(64)]
        keys += [k for k, p in zip(candidates, placement.primaries(candidates).tolist(), strict=True) if p == primary]
    return keys[:n]


def put(local: LocalCluster, token: str, keys: list[bytes], batch: int = 12) -> None:
    with Client(local.config, token=token) as client:
        for start in range(0, len(keys), batch):
            chunk = keys[start : start + batch]
            assert all(client.put(chunk, [os.urandom(BLOCK) for _ in chunk]))


def stored(local: LocalCluster, token: str, keys: list[bytes]) -> np.ndarray:
    with Client(local.config, token=token) as client:
        return np.asarray(client.exists(keys))


def evictions(local: LocalCluster, node_id: int) -> int:
    with Client(local.config) as admin:
        gc = admin.node_info([node_id])[node_id]["gc"]
    return gc["evictions"] + gc["evictions_on_demand"]


# -- the policy ------------------------------------------------------------------------------------------------


def test_without_quotas_the_tenants_holding_blocks_share_the_budget_equally() -> None:
    assert TenantShares({}).entitled(1200, ["a"]) == {"a": 1200}
    assert TenantShares({}).entitled(1200, ["a", "b", "c"]) == {"a": 400, "b": 400, "c": 400}


def test_quotas_are_shares_of_the_budget_and_tenants_without_one_split_the_rest() -> None:
    shares = TenantShares({"a": 0.5, "b": 0.25})
    assert shares.entitled(1000, ["a", "c", "d"]) == {"a": 500, "b": 250, "c": 125, "d": 125}


def lru(blocks: dict[str, list[tuple[str, int]]]):
    return lambda tenant: iter(blocks.get(tenant, []))


def test_removals_take_from_the_tenant_furthest_over_its_share_first() -> None:
    blocks = {"a": [(f"a{i}", 10) for i in range(10)], "b": [(f"b{i}", 10) for i in range(4)]}
    usage, entitled = {"a": 100, "b": 40}, {"a": 50, "b": 50}
    assert plan_removals(30, usage, entitled, lru(blocks), usage, beyond_share=False) == ["a0", "a1", "a2"]
    # a is 50 over, b 10 under: a goes down to b's level first, then they take turns
    taken = plan_removals(80, usage, entitled, lru(blocks), usage, beyond_share=False)
    assert taken == ["a0", "a1", "a2", "a3", "a4", "a5", "a6", "b0"]


def test_removals_beyond_shares_stop_at_every_tenants_share() -> None:
    blocks = {"a": [(f"a{i}", 10) for i in range(10)], "b": [(f"b{i}", 10) for i in range(4)]}
    usage, entitled = {"a": 100, "b": 40}, {"a": 50, "b": 50}
    assert plan_removals(500, usage, entitled, lru(blocks), ["a", "b"], beyond_share=True) == [
        f"a{i}" for i in range(5)
    ]
    assert plan_removals(500, usage, entitled, lru(blocks), ["b"], beyond_share=True) == []


def test_one_tenant_is_plain_lru() -> None:
    blocks = {"a": [(f"a{i}", 10) for i in range(10)]}
    assert plan_removals(25, {"a": 100}, {"a": 100}, lru(blocks), ["a"], beyond_share=False) == ["a0", "a1", "a2"]


@pytest.mark.parametrize(
    ("quotas", "message"),
    [
        ("quota = 0", "tenants.a.quota must be a share of the budget above 0 and at most 1"),
        ("quota = 1.5", "tenants.a.quota must be a share of the budget above 0 and at most 1"),
        ('quota = "half"', "tenants.a.quota: expected `float | null`"),
    ],
)
def test_a_bad_quota_is_refused_in_one_line(tmp_path, quotas: str, message: str) -> None:
    path = cluster_mod.write_default(tmp_path)
    path.write_text(path.read_text() + f'\n[tenants.a]\ntoken = "{TOKEN_A}"\n{quotas}\n')
    with pytest.raises(cluster_mod.ConfigError, match=message.replace("|", r"\|")):
        cluster_mod.load(path)


def test_quotas_adding_up_past_the_whole_budget_are_refused(tmp_path) -> None:
    path = cluster_mod.write_default(tmp_path)
    path.write_text(path.read_text() + "\n" + tenants(0.6, 0.5))
    with pytest.raises(cluster_mod.ConfigError, match=r"quotas add up to 1\.1; together they may not pass 1"):
        cluster_mod.load(path)


# -- real nodes ------------------------------------------------------------------------------------------------


def test_a_put_header_never_followed_by_its_payload_evicts_nothing_of_another_tenant(own_cluster) -> None:
    local = own_cluster(capacity_bytes=CAPACITY, gc=ON_DEMAND_ONLY, extra_toml=tenants())
    kept = keys_at(local, PRIMARY, 200)
    put(local, TOKEN_A, kept)  # twice what the primary's budget holds: it is full of tenant a's blocks
    kept = [k for k, s in zip(kept, stored(local, TOKEN_A, kept), strict=True) if s]
    assert len(kept) >= 80
    before = evictions(local, PRIMARY)
    # tenant b announces 40 shard 0s of 1 MiB to that primary, and never sends them
    node = local.config.nodes[PRIMARY]
    attacker = socket.create_connection((node.host, node.port), timeout=10)
    try:
        attacker.sendall(encode_head(Op.HELLO, 1, {"token": TOKEN_B}))
        attacker.recv(4096)
        rows = keys_at(local, PRIMARY, 40)
        meta = {
            "keys": b"".join(rows),
            "klen": 16,
            "idx": bytes(40),
            "lens": np.full(40, 1 << 20, dtype="<u4").tobytes(),
            "blen": np.full(40, 10 << 20, dtype="<u8").tobytes(),
            "cls": "chatbot",
            "put": b"attack",
        }
        attacker.sendall(encode_head(Op.PUT_SHARDS, 2, meta, 40 << 20))
        time.sleep(4)  # the reservation, its wait for room (room_wait_s) and several GC cycles
        assert stored(local, TOKEN_A, kept).all()
        assert evictions(local, PRIMARY) == before
    finally:
        attacker.close()


def test_a_tenant_over_its_quota_evicts_only_its_own_blocks(own_cluster) -> None:
    local = own_cluster(capacity_bytes=CAPACITY, gc=ON_DEMAND_ONLY, extra_toml=tenants(0.5, 0.5))
    theirs = keys_at(local, PRIMARY, 40)  # b: within its half of the budget
    put(local, TOKEN_B, theirs)
    mine = keys_at(local, PRIMARY, 200)
    put(local, TOKEN_A, mine)  # a fills the other half, then keeps writing: it must make room from its own
    assert stored(local, TOKEN_B, theirs).all()
    assert 0 < stored(local, TOKEN_A, mine).sum() < 200
    assert stored(local, TOKEN_A, mine[-12:]).all()


def test_a_tenant_under_its_quota_takes_room_from_one_over_its_quota(own_cluster) -> None:
    local = own_cluster(capacity_bytes=CAPACITY, gc=ON_DEMAND_ONLY, extra_toml=tenants(0.5, 0.5))
    older = keys_at(local, PRIMARY, 200)
    put(local, TOKEN_A, older)  # b writes nothing yet: a takes the whole budget
    held = stored(local, TOKEN_A, older)
    assert held.sum() >= 80
    theirs = keys_at(local, PRIMARY, 36)
    put(local, TOKEN_B, theirs)  # a full primary takes every write: b is owed its half
    assert stored(local, TOKEN_B, theirs).all()
    now = stored(local, TOKEN_A, older)
    lost = np.flatnonzero(held & ~now)
    assert len(lost) >= 30
    survivors = np.flatnonzero(now)
    assert lost.max() < survivors.min()  # a's least recently used went
