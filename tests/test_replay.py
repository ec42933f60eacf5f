"""Trace replay (simulation) and the trace generators: hand-computed small traces, properties, and the CLI."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.tools.capacity import cluster_capacity, local_capacity
from kvtier.tools.kvbench import main as kvbench
from kvtier.tools.replay import replay
from kvtier.tools.traces import (
    Request,
    TraceError,
    load_trace,
    mixed_trace,
    multi_turn_trace,
    read_trace,
    shared_prefix_trace,
    write_trace,
)

B = 512  # tokens per block in the hand-computed traces


def req(ids: list[int], t: float = 0, input_length: int | None = None, ttl_class: str | None = None) -> Request:
    """A request whose input fills its blocks exactly unless ``input_length`` says otherwise."""
    return Request(t, len(ids) * B if input_length is None else input_length, 0, ids, ttl_class)


def sequential(*id_lists: list[int]) -> list[Request]:
    return [req(ids, t=i) for i, ids in enumerate(id_lists)]


# --- hand-computed traces ---


def test_lru_three_requests_capacity_three_blocks() -> None:
    # [1,2,3]: nothing stored → hit 0; store 1,2,3 (full).           LRU order: 1 2 3
    # [1,2,4]: 1,2 stored, 4 not → hit 2 blocks; touch 1,2 → order 3 1 2; store 4 evicts 3 → 1 2 4
    # [5]:     miss; store 5 evicts 1 → 2 4 5
    # hit blocks 2 of 7; tokens 2×512 of 7×512 → 2/7 both; 2 evictions; 3+1+1 = 5 blocks written.
    result = replay(sequential([1, 2, 3], [1, 2, 4], [5]), capacity_tokens=3 * B)
    assert result.requests == 3
    assert result.token_hit_ratio == pytest.approx(2 / 7)
    assert result.block_hit_ratio == pytest.approx(2 / 7)
    assert result.evictions == 2
    assert result.blocks_written == 5
    assert result.blocks_read == 2
    assert result.capacity_blocks == 3
    assert result.max_blocks_stored == 3
    assert result.blocks_stored_at_end == 3
    # The ideal (infinite capacity) also reuses only 1,2 in the second request here.
    assert result.ideal_token_hit_ratio == pytest.approx(2 / 7)


def test_capacity_rounds_down_to_whole_blocks() -> None:
    # 3.9 blocks' worth of tokens holds 3 blocks: same as the trace above.
    result = replay(sequential([1, 2, 3], [1, 2, 4], [5]), capacity_tokens=4 * B - 1)
    assert result.capacity_blocks == 3
    assert result.evictions == 2


def test_hit_is_the_leading_run_only() -> None:
    # [1,2,3] stored; [1,9,3]: 1 hits, 9 misses, 3 is stored but after a miss → hit 1 block.
    result = replay(sequential([1, 2, 3], [1, 9, 3]))
    assert result.blocks_read == 1
    assert result.block_hit_ratio == pytest.approx(1 / 6)
    assert result.blocks_written == 4  # 1,2,3 then 9


def test_hit_tokens_are_capped_by_the_input_length() -> None:
    # Both requests: 2 blocks, 700 tokens (the second block partial). Second hits both blocks,
    # min(2×512, 700) = 700 tokens → token ratio 700/1400 = 0.5; block ratio 2/4 = 0.5.
    # A third request [1,2,3] of 1100 tokens hits 1024 tokens: min(1024, 1100).
    trace = [req([1, 2], 0, 700), req([1, 2], 1, 700), req([1, 2, 3], 2, 1100)]
    result = replay(trace)
    assert result.hit_tokens == 700 + 1024
    assert result.token_hit_ratio == pytest.approx((700 + 1024) / (700 + 700 + 1100))
    assert result.block_hit_ratio == pytest.approx(4 / 7)


def test_lru_order_follows_the_requests_block_order() -> None:
    # Capacity 2. [1,2] → order 1 2. [2,1] hits both, touched in order 2 then 1 → order 2 1.
    # [3] evicts 2 (the LRU), so [1] hits and [2] misses.
    result = replay(sequential([1, 2], [2, 1], [3], [1], [2]), capacity_tokens=2 * B)
    # hits: 0, 2, 0, 1, 0 → 3 of 7 blocks
    assert result.blocks_read == 3
    assert result.evictions == 2  # 3 evicts 2; the last [2] evicts 3 (order then: 3 1 → evict 3)


def test_a_request_larger_than_the_store_evicts_its_own_first_blocks() -> None:
    # Capacity 2, [1,2,3,4]: 3 evicts 1, 4 evicts 2 → store holds 3 4; then [1,2,3,4] misses at 1.
    result = replay(sequential([1, 2, 3, 4], [1, 2, 3, 4]), capacity_tokens=2 * B)
    assert result.blocks_read == 0
    assert result.evictions == 2 + 4
    assert result.max_blocks_stored == 2


def test_watermark_hysteresis_differs_from_plain_lru() -> None:
    # Capacity 10 blocks, watermarks 0.9/0.8: evict when count > 9, down to <= 8.
    # A [1..9]: count 9, not > 9 → no eviction (LRU: same).
    # B [10]:   count 10 > 9 → evict LRU 1, 2 → 8 blocks (3..10). LRU: 10 blocks, full, nothing evicted.
    # C [1,2,3]: LRU hits 3 blocks. Watermarks: 1 is gone → hit 0; store 1 (count 9), store 2 (count 10 > 9 →
    #           evict 3, 4 → 8), store 3 (count 9). Watermark evictions 2 + 2 = 4, written 9 + 1 + 3 = 13.
    trace = sequential(list(range(1, 10)), [10], [1, 2, 3])
    lru = replay(trace, capacity_tokens=10 * B)
    hysteresis = replay(trace, capacity_tokens=10 * B, watermarks=(0.9, 0.8))
    assert (lru.blocks_read, lru.evictions, lru.blocks_written) == (3, 0, 10)
    assert lru.token_hit_ratio == pytest.approx(3 / 13)
    assert (hysteresis.blocks_read, hysteresis.evictions, hysteresis.blocks_written) == (0, 4, 13)
    assert hysteresis.token_hit_ratio == 0.0
    assert hysteresis.max_blocks_stored == 10
    assert hysteresis.blocks_stored_at_end == 9


def test_watermarks_evict_within_one_request() -> None:
    # Capacity 4, watermarks 0.9/0.5 (evict when > 3.6, down to <= 2). [1..6]:
    # 1,2,3 → 3 blocks; 4 → 4 > 3.6 → evict 1,2 → {3,4}; 5 → 3; 6 → 4 → evict 3,4 → {5,6}.
    result = replay(sequential([1, 2, 3, 4, 5, 6], [5, 6]), capacity_tokens=4 * B, watermarks=(0.9, 0.5))
    assert result.evictions == 4
    assert result.blocks_read == 2  # the second request hits 5, 6
    assert result.max_blocks_stored == 4
    assert result.blocks_stored_at_end == 2


def test_watermark_at_full_capacity_still_never_exceeds_it() -> None:
    # high = 1.0 never fires (the count cannot pass the capacity), so the immediate eviction keeps the bound:
    # capacity 3, [1..5] → 4 evicts 1, 5 evicts 2.
    result = replay(sequential([1, 2, 3, 4, 5]), capacity_tokens=3 * B, watermarks=(1.0, 0.5))
    assert result.evictions == 2
    assert result.max_blocks_stored == 3


def test_ttl_expiry_uses_trace_timestamps() -> None:
    # TTL chatbot = 10 s = 10,000 ms; blocks expire when created + 10,000 < request timestamp.
    # t=0      [1,2]:   miss; store 1,2 (created 0).                                       written 2
    # t=5000   [1,2,3]: 1,2 alive → hit 2; store 3 (created 5000).                         written 3
    # t=10000  [1,2]:   0 + 10000 is not < 10000 → alive → hit 2.
    # t=10001  [1,2,3]: 1,2 expired (2 expirations) → hit 0; re-store 1,2 (created 10001); 3 alive, touched. written 5
    # t=15001  [3]:     3 created 5000 expires (touching did not extend it) → 3rd expiration; hit 0.  written 6
    trace = [req([1, 2], 0), req([1, 2, 3], 5000), req([1, 2], 10000), req([1, 2, 3], 10001), req([3], 15001)]
    result = replay(trace, ttl={"chatbot": 10.0})
    assert result.expirations == 3
    assert result.blocks_read == 4
    assert result.block_hit_ratio == pytest.approx(4 / 11)
    assert result.blocks_written == 6
    # Without TTL: hits 0, 2, 2, 3, 1 = 8 of 11, which is also the ideal.
    assert result.ideal_token_hit_ratio == pytest.approx(8 / 11)
    assert replay(trace).block_hit_ratio == pytest.approx(8 / 11)


def test_ttl_is_per_class_and_every_class_needs_one() -> None:
    # agent blocks live 1 s, chatbot (the default class) 100 s; both re-requested 2 s later.
    trace = [req([1], 0, ttl_class="agent"), req([2], 0), req([1], 2000, ttl_class="agent"), req([2], 2000)]
    result = replay(trace, ttl={"agent": 1.0, "chatbot": 100.0})
    assert result.expirations == 1
    assert result.blocks_read == 1  # only the chatbot block hits
    with pytest.raises(ValueError, match="'agent'"):
        replay(trace, ttl={"chatbot": 100.0})


def test_an_expired_block_frees_its_capacity() -> None:
    # Capacity 2, TTL 1 s. [1,2] at 0; at 5000 both expired and removed, so [3,4] needs no eviction.
    result = replay([req([1, 2], 0), req([3, 4], 5000)], capacity_tokens=2 * B, ttl={"chatbot": 1.0})
    assert (result.expirations, result.evictions) == (2, 0)


def test_bytes_moved_count_whole_blocks() -> None:
    # block 4 tokens, 2 bytes/token → 8 bytes a block; [1,2] then [1,2,3]: written 3 blocks, read 2.
    trace = [Request(0, 8, 0, [1, 2]), Request(1, 12, 0, [1, 2, 3])]
    result = replay(trace, block_tokens=4, bytes_per_token=2)
    assert (result.bytes_written, result.bytes_read) == (24, 16)
    assert replay(trace, block_tokens=4).bytes_written == 0


def test_capacity_below_one_block_stores_nothing() -> None:
    result = replay(sequential([1], [1]), capacity_tokens=B - 1)
    assert (result.blocks_read, result.blocks_written, result.max_blocks_stored) == (0, 0, 0)


def test_decoded_trace_lines_are_accepted() -> None:
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [7, 8]}] * 2
    assert replay(lines).blocks_read == 2


def test_out_of_order_timestamps_and_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="earlier"):
        replay([req([1], 10), req([2], 5)])
    with pytest.raises(ValueError, match="watermarks"):
        replay([], capacity_tokens=B, watermarks=(0.5, 0.9))
    with pytest.raises(ValueError, match="block_tokens"):
        replay([], block_tokens=0)
    with pytest.raises(ValueError, match="positive"):
        replay([], ttl={"chatbot": 0})


def test_empty_trace_gives_zero_ratios() -> None:
    result = replay([])
    assert (result.requests, result.token_hit_ratio, result.block_hit_ratio) == (0, 0.0, 0.0)


# --- properties on generated traces ---


@pytest.fixture(scope="module")
def mixed() -> list[Request]:
    return mixed_trace(3000, seed=7)


@pytest.mark.parametrize("watermarks", [None, (0.9, 0.8), (0.75, 0.25)])
@pytest.mark.parametrize("capacity_blocks", [0, 1, 7, 100, 2000])
def test_capacity_is_never_exceeded(
    mixed: list[Request], capacity_blocks: int, watermarks: tuple[float, float] | None
) -> None:
    result = replay(mixed, capacity_tokens=capacity_blocks * B, watermarks=watermarks, ttl={"chatbot": 60, "agent": 30})
    assert result.max_blocks_stored <= capacity_blocks
    assert result.blocks_stored_at_end <= capacity_blocks
    if watermarks and capacity_blocks:
        assert result.blocks_stored_at_end <= watermarks[0] * capacity_blocks


def test_ideal_equals_infinite_capacity_without_ttl_and_bounds_every_capacity(mixed: list[Request]) -> None:
    infinite = replay(mixed)
    assert infinite.token_hit_ratio == infinite.ideal_token_hit_ratio > 0.3
    assert infinite.evictions == 0
    assert infinite.blocks_written == len({h for r in mixed for h in r.hash_ids})
    previous = 0.0
    for blocks in (10, 100, 1000, 10_000):
        result = replay(mixed, capacity_tokens=blocks * B)
        assert result.ideal_token_hit_ratio == infinite.ideal_token_hit_ratio
        # LRU is a stack algorithm: a bigger store holds a superset, so the hit ratio cannot drop.
        assert previous <= result.token_hit_ratio <= result.ideal_token_hit_ratio
        previous = result.token_hit_ratio


def test_ttl_lowers_the_hit_ratio_below_the_ideal(mixed: list[Request]) -> None:
    result = replay(mixed, ttl={"chatbot": 30, "agent": 30})
    assert result.expirations > 0
    assert result.token_hit_ratio < result.ideal_token_hit_ratio


# --- generators ---


@pytest.mark.parametrize("generate", [multi_turn_trace, shared_prefix_trace, mixed_trace])
def test_generators_are_deterministic_by_seed(generate, tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_trace(a, generate(500, seed=3))
    write_trace(b, generate(500, seed=3))
    write_trace(c, generate(500, seed=4))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("generate", [multi_turn_trace, shared_prefix_trace, mixed_trace])
def test_generated_traces_have_increasing_timestamps_and_the_requested_size(generate) -> None:
    trace = generate(777, seed=1)
    assert len(trace) == 777
    stamps = [r.timestamp for r in trace]
    assert all(isinstance(t, int) for t in stamps)
    assert all(a < b for a, b in itertools.pairwise(stamps))
    for r in trace:
        assert r.hash_ids
        assert (len(r.hash_ids) - 1) * B < r.input_length <= len(r.hash_ids) * B


def test_multi_turn_turns_extend_the_previous_turn() -> None:
    trace = multi_turn_trace(400, seed=2)
    by_first: dict[int, list[Request]] = {}
    for r in trace:  # the first block of a conversation is unique to it
        by_first.setdefault(r.hash_ids[0], []).append(r)
    assert any(len(turns) >= 3 for turns in by_first.values())
    for turns in by_first.values():
        for prev, cur in itertools.pairwise(turns):
            assert cur.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
            assert len(cur.hash_ids) > len(prev.hash_ids)
            assert cur.timestamp > prev.timestamp


def test_shared_prefix_requests_share_leading_blocks() -> None:
    trace = shared_prefix_trace(1000, seed=5, n_prompts=4, prompt_blocks=(3, 3))
    prefixes = [tuple(r.hash_ids[:3]) for r in trace]
    assert len(set(prefixes)) <= 4
    most_common = max(set(prefixes), key=prefixes.count)
    assert prefixes.count(most_common) > 250  # Zipf: the first prompt dominates
    tails = [h for r in trace for h in r.hash_ids[3:]]
    assert len(tails) == len(set(tails))  # user parts are never shared


def test_mixed_trace_has_conversations_agents_and_reuse() -> None:
    trace = mixed_trace(2000, seed=9)
    classes = {r.ttl_class for r in trace}
    assert classes == {None, "agent"}
    result = replay(trace)
    assert 0.3 < result.ideal_token_hit_ratio < 0.99
    assert 10 <= result.total_blocks / len(trace) <= 40


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    trace = mixed_trace(200, seed=11)
    path = tmp_path / "t.jsonl"
    assert write_trace(path, trace) == 200
    assert load_trace(path) == trace


def test_read_trace_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n\n{"timestamp": 1, "input_\n'
    )
    with pytest.raises(TraceError, match=r"bad\.jsonl:3: malformed JSON"):
        list(read_trace(path))
    path.write_text('{"timestamp": 0, "input_length": 512}\n')
    with pytest.raises(TraceError, match=r":1: missing field 'hash_ids'"):
        list(read_trace(path))
    path.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1, "x"]}\n')
    with pytest.raises(TraceError, match="list of integers"):
        list(read_trace(path))


# --- a cluster's capacity (tools.capacity) ---


def test_a_clusters_blocks_count_erasure_coding_slot_rounding_and_primary_budgets() -> None:
    store = local_capacity(2 << 20, 64 << 10)  # 12 nodes of 2 MiB, blocks of 64 KiB
    assert store.shard_bytes == 6554  # ceil(64 KiB / 10): 12 of them are 1.2× the block
    assert store.slot_bytes == 7168  # the 7 KiB size class holds a 6,554-byte shard
    assert store.primaries == dict.fromkeys(range(12), 24)  # budget 2 MiB / 12 = 174,762 B: 24 slots of 7 KiB
    assert store.blocks == 288  # not 12 × 2 MiB / 64 KiB = 384
    assert store.watermarks == (0.9, 0.8)


def test_a_cluster_files_capacity_uses_its_smallest_node_and_its_watermarks(tmp_path: Path) -> None:
    path = cluster_mod.write_default(tmp_path, capacity_bytes=4 << 20, base_port=7400)
    text = path.read_text().replace('capacity = "4MiB"', 'capacity = "2MiB"', 1)
    path.write_text(text.replace("low_watermark = 0.8", "low_watermark = 0.5"))
    store = cluster_capacity(cluster_mod.load(path), 64 << 10)
    assert store.blocks == 288 and store.watermarks == (0.9, 0.5)  # node 0's 2 MiB bounds every budget


def test_one_lru_per_primary_hits_less_than_one_lru_over_them_all() -> None:
    trace = multi_turn_trace(400, seed=3, block_tokens=64)
    store = local_capacity(4 << 20, 64 << 10)
    pooled = replay(trace, block_tokens=64, store=store)
    per_primary = replay(trace, block_tokens=64, store=store, per_primary=True)
    assert pooled.capacity_blocks == per_primary.capacity_blocks == 576
    assert per_primary.token_hit_ratio < pooled.token_hit_ratio < pooled.ideal_token_hit_ratio
    assert per_primary.max_blocks_stored <= 576


def test_cli_takes_the_capacity_from_a_cluster_file_or_a_node_capacity(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster_mod.write_default(tmp_path, capacity_bytes=4 << 20, base_port=7400)
    sizes = ["--block-tokens", "64", "--bytes-per-token", "1KiB", "--json"]
    assert kvbench(["--config", str(path), "replay", str(trace_file), *sizes]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert kvbench(["replay", str(trace_file), "--node-capacity", "4MiB", *sizes]) == 0
    from_size = json.loads(capsys.readouterr().out)
    assert from_file == from_size | {"trace": from_file["trace"]}
    assert from_file["capacity_blocks"] == 576 and from_file["store"]["slot_bytes"] == 7168
    assert from_file["watermarks"] == [0.9, 0.8] and from_file["per_primary"] is True
    expected = replay(
        load_trace(trace_file), block_tokens=64, store=local_capacity(4 << 20, 64 << 10), per_primary=True
    )
    assert from_file["token_hit_ratio"] == expected.token_hit_ratio


# --- CLI ---


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    write_trace(path, mixed_trace(1500, seed=21))
    return path


def test_cli_json_matches_the_library(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(trace_file), "--capacity-tokens", "200000", "--ttl", "chatbot=10m", "--ttl", "agent=5m", "--json"]
    argv += ["--watermarks", "0.9,0.8", "--bytes-per-token", "1KiB"]
    assert kvbench(["replay", *argv]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    expected = replay(
        load_trace(trace_file),
        capacity_tokens=200_000,
        watermarks=(0.9, 0.8),
        ttl={"chatbot": 600.0, "agent": 300.0},
        bytes_per_token=1024,
    )
    for key in ("token_hit_ratio", "block_hit_ratio", "ideal_token_hit_ratio", "evictions", "requests"):
        assert data[key] == getattr(expected, key)
    assert data["expirations"] == expected.expirations
    assert data["bytes_written"] == expected.bytes_written > 0
    assert data["capacity_tokens"] == 200_000
    assert err == ""


def test_cli_infinite_capacity_and_table_output(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvbench(["replay", str(trace_file), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["capacity_tokens"] is None
    assert data["token_hit_ratio"] == data["ideal_token_hit_ratio"]
    assert kvbench(["replay", str(trace_file), "--capacity-tokens", "100000"]) == 0
    assert "token hit ratio" in capsys.readouterr().out


def test_cli_sweep_writes_csv_and_plot(trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    argv = [str(trace_file), "--sweep", "51200,512000,inf", "--out", str(out), "--json"]
    assert kvbench(["replay", *argv]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["capacity_tokens"] for row in data["sweep"]] == [51200, 512000, None]
    lines = (out / "sweep.csv").read_text().splitlines()
    assert lines[0].startswith("capacity_tokens,capacity_blocks,token_hit_ratio")
    assert lines[1].startswith("51200,100,") and lines[3].startswith("inf,inf,")
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (out / "sweep.png").exists() == has_matplotlib
    assert (data["plot"] is not None) == has_matplotlib


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{missing}"], "trace file not found"),
        (["{bad}"], "bad.jsonl:2: malformed JSON"),
        (["{trace}", "--ttl", "chatbot=soon"], "--ttl 'chatbot=soon': bad duration"),
        (["{trace}", "--ttl", "7d"], "use CLASS=DURATION"),
        (["{trace}", "--capacity-tokens", "lots"], "--capacity-tokens 'lots'"),
        (["{trace}", "--watermarks", "0.5,0.9"], "need 0 < LOW <= HIGH <= 1"),
        (["{trace}", "--mode", "live"], "--mode live drives a running cluster"),
        (["{trace}", "--ttl", "agent=1h"], "TTL class 'chatbot'"),
        (["{trace}", "--node-capacity", "4MiB"], "give --bytes-per-token"),
        (["{trace}", "--node-capacity", "4MiB", "--bytes-per-token", "1KiB", "--capacity-tokens", "9"], "cluster's"),
        (["{trace}", "--node-capacity", "4MiB", "--bytes-per-token", "1KiB", "--nodes", "13"], "multiple of 12"),
        (["{trace}", "--one-lru"], "--one-lru goes with a cluster's capacity"),
        (["{trace}", "--salt", "xyz"], "--salt 'xyz': use hex digits"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(
    argv: list[str], message: str, trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\n{"timestamp": 1,\n')
    paths = {"missing": tmp_path / "nope.jsonl", "bad": bad, "trace": trace_file}
    assert kvbench(["replay", *(a.format(**paths) for a in argv)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("kvbench: error: ")
    assert message in err
    assert "Traceback" not in err
