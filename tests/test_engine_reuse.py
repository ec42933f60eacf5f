"""Prefill against a real local cluster: the hit rule, exact reuse, bounded replay, and a store that is down."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.engine.checkpoint import make_checkpoint
from kvtier.engine.engine import Engine, PromptError
from kvtier.engine.reuse import Plan, Reuse, plan
from kvtier.engine.stateblocks import LocalStateBlocks
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.keys import chain, header_digests
from kvtier.tools.kvbench import main as kvbench
from kvtier.transfer.fetcher import LocalFetcher

TOLERANCE = 1e-4
MakeEngine = Callable[..., Engine]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cluster_file(make_cluster) -> Path:
    return make_cluster(capacity_bytes=64 << 20).config_path


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the hit rule ---------------------------------------------------------------------------------------


def always(h: int) -> bool:
    return True


def never(h: int) -> bool:
    return False


def test_hit_leaves_window_plus_six_and_falls_on_multiples_of_128() -> None:
    assert plan(2000, 1984, 64, 128, always) == Plan(1792, Reuse.EXACT)  # cap 2000 - 134 = 1866
    assert plan(2000, 1000, 64, 128, always) == Plan(896, Reuse.EXACT)
    assert plan(262, 256, 64, 128, always) == Plan(128, Reuse.EXACT)
    assert plan(261, 256, 64, 128, always) == Plan(0, Reuse.NONE)


def test_missing_state_at_the_hit_means_bounded_replay() -> None:
    assert plan(2000, 1984, 64, 128, never) == Plan(1792, Reuse.REPLAY)
    asked: list[int] = []
    plan(2000, 1984, 64, 128, lambda h: asked.append(h) or False)
    assert asked == [1792]


def test_without_sliding_layers_the_hit_is_block_aligned_up_to_the_last_token() -> None:
    assert plan(641, 640, 64, None, never) == Plan(640, Reuse.EXACT)
    assert plan(640, 640, 64, None, never) == Plan(576, Reuse.EXACT)
    assert plan(64, 64, 64, None, never) == Plan(0, Reuse.NONE)


# -- the paged path -------------------------------------------------------------------------------------


def test_a_run_of_pages_is_one_view_that_one_copy_fills(checkpoint: Path, engine: MakeEngine) -> None:
    cache = engine(checkpoint, None).cache
    rows = torch.randint(0, 256, (3, cache.page_bytes), dtype=torch.uint8)
    cache.block_run(5, 3).copy_(rows)
    assert all(torch.equal(cache.block(5 + i), rows[i]) for i in range(3))
    assert not cache.block(4).any() and not cache.block(8).any()


def test_pages_given_back_are_handed_out_again_lowest_first(checkpoint: Path, engine: MakeEngine) -> None:
    cache = engine(checkpoint, None).cache
    first, held = cache.allocate(10), cache.allocate(5)
    cache.release(first)
    again = cache.allocate(12)  # a request's pages are runs of consecutive pages: a fetch copies a run at once
    assert again == [*range(10), *range(15, 17)]
    cache.release(again[::-1])
    assert cache.allocate(3) == [0, 1, 2]
    assert held == list(range(10, 15))


def test_paged_greedy_decoding_equals_full_forwards(checkpoint: Path, engine: MakeEngine) -> None:
    e = engine(checkpoint, None)
    p = prompt(700, seed=1)
    result = e.generate([p], 12)[0]
    tokens = list(p)
    for _ in range(12):
        tokens.append(int(e.logits(tokens)[-1].argmax()))
    assert result.tokens == tokens[len(p) :]
    assert (result.first_logits - e.logits(p)[-1]).abs().max().item() <= TOLERANCE
    assert e.cache.free_pages == len(e.cache.pages)  # every page back


def test_a_prompt_longer_than_the_context_is_one_clear_error(checkpoint: Path, engine: MakeEngine) -> None:
    e = engine(checkpoint, None)
    too_long = [1] * (e.config.max_position_embeddings + 1)
    with pytest.raises(PromptError, match="longer than the model's context") as info:
        e.generate([[1, 2, 3], too_long], 4)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "bad",
    [[1, 2.5, 3], [1, -1], [1, 2**40], np.array([1.0, 2.5]), np.array([True, False]), np.array([[1, 2], [3, 4]])],
    ids=["float", "negative", "huge", "float-array", "bool-array", "2d-array"],
)
def test_token_ids_that_are_not_vocabulary_ids_are_one_clear_error(
    checkpoint: Path, engine: MakeEngine, bad: list | np.ndarray
) -> None:
    e = engine(checkpoint, None)
    with pytest.raises(PromptError, match="token ids must be") as info:
        e.generate([bad], 1)
    assert "\n" not in str(info.value)


# -- with the store -------------------------------------------------------------------------------------


def test_exact_reuse_gives_the_same_logits_and_tokens_as_no_reuse(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine
) -> None:
    e = engine(checkpoint, cluster_file)
    p = prompt(2000, seed=2)
    cold = e.generate([p], 32)[0]
    warm = e.generate([p], 32)[0]
    plain = e.generate([p], 32, reuse=False)[0]
    assert (cold.hit_tokens, warm.hit_tokens, warm.replayed) == (0, 1792, False)
    assert warm.tokens == cold.tokens == plain.tokens
    assert (warm.first_logits - plain.first_logits).abs().max().item() <= TOLERANCE


def test_a_block_gone_between_lookup_and_read_re_plans_the_hit_from_the_blocks_that_landed(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(checkpoint, cluster_file)
    assert e.store is not None
    p = prompt(2000, seed=21)
    e.generate([p], 1)
    looked_up = e.store.match

    def evicted_after_lookup(keys: list[bytes]) -> int:  # block 20 goes after match counted it
        found = looked_up(keys)
        e.store.client.delete([keys[20]])
        return found

    monkeypatch.setattr(e.store, "match", evicted_after_lookup)
    warm = e.generate([p], 16)[0]  # the fetch comes up short at block 20: re-planned with what landed
    plain = e.generate([p], 16, reuse=False)[0]
    assert (warm.hit_tokens, warm.replayed) == (1280, False)  # block 20 starts at 1280: its StateBlock is there
    assert warm.tokens == plain.tokens
    assert (warm.first_logits - plain.first_logits).abs().max().item() <= TOLERANCE
    assert e.cache.free_pages == len(e.cache.pages)


def test_the_block_store_answers_keys_and_headers_of_any_prefix_from_the_chain_it_keeps(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine
) -> None:
    store = engine(checkpoint, cluster_file).store
    assert store is not None
    tokens, other = np.array(prompt(2000, seed=5), np.uint32), np.array(prompt(1000, seed=6), np.uint32)
    full = chain(store.namespace, tokens, store.hash_algo)
    assert store.keys(tokens) == full and store.keys(tokens[:700]) == full[:10]  # 700 tokens: 10 full blocks
    assert store.headers(full[3:9], tokens[:640]) == header_digests(store.namespace, tokens, full)[3:9]
    assert store.keys(other) == chain(store.namespace, other, store.hash_algo)  # another prompt: chained anew
    with pytest.raises(ValueError, match="not blocks of the given tokens"):
        store.headers(full[:2], other)


def test_a_later_turn_reuses_the_earlier_turn_exactly(checkpoint: Path, cluster_file: Path, engine: MakeEngine) -> None:
    e = engine(checkpoint, cluster_file)
    first = prompt(1000, seed=3)
    e.generate([first], 4)
    second = first + prompt(400, seed=4)
    turn = e.generate([second], 16)[0]
    assert (turn.hit_tokens, turn.replayed) == (896, False)  # the first turn's 15 blocks; its StateBlock at 896
    plain = e.generate([second], 16, reuse=False)[0]
    assert turn.tokens == plain.tokens
    assert (turn.first_logits - plain.first_logits).abs().max().item() <= TOLERANCE


def test_the_next_turn_reuses_the_answer_decode_wrote(checkpoint: Path, cluster_file: Path, engine: MakeEngine) -> None:
    e = engine(checkpoint, cluster_file)
    first = prompt(1000, seed=12)
    answer = e.generate([first], 200)[0].tokens  # decode computes positions up to 1198: blocks to 1151
    second = first + answer + prompt(300, seed=13)
    turn = e.generate([second], 16)[0]
    assert (turn.hit_tokens, turn.replayed) == (1152, False)  # StateBlock at 1152 saved during decode
    plain = e.generate([second], 16, reuse=False)[0]
    assert turn.tokens == plain.tokens
    assert (turn.first_logits - plain.first_logits).abs().max().item() <= TOLERANCE


def test_block_kv_without_its_state_is_replayed_and_never_stored(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine
) -> None:
    producer = engine(checkpoint, cluster_file)
    p = prompt(2000, seed=5)
    producer.generate([p], 1)
    states = LocalStateBlocks()
    consumer = engine(checkpoint, cluster_file, states)  # another host: the store's blocks, no StateBlocks
    longer = p + prompt(300, seed=6)
    result = consumer.generate([longer], 8)[0]
    assert (result.hit_tokens, result.replayed) == (1920, True)
    assert len(states) == 0
    keys = consumer.store.keys(longer)
    assert consumer.store.match(keys) == len(p) // 64 < len(keys)  # none of the replayed request's blocks


class StoreWatchingStateBlocks(LocalStateBlocks):
    """A StateBlock pool that notes, at each put, how many blocks of ``keys`` the store already holds."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.keys: list[bytes] = []
        self.held_at_put: list[int] = []

    def put(self, key: bytes, data: torch.Tensor) -> None:
        assert self.engine is not None and self.engine.store is not None
        self.held_at_put.append(self.engine.store.match(self.keys))
        super().put(key, data)


def test_a_prompts_state_blocks_are_in_their_pool_before_its_blocks_are_in_the_store(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine
) -> None:
    """Blocks were published before their StateBlocks: a request whose lookup came between the two found the blocks
    without their StateBlock and replayed the window (test_kv_formats' warm run did so under make test)."""
    states = StoreWatchingStateBlocks()
    e = engine(checkpoint, cluster_file, states)
    p = prompt(700, seed=41)
    states.engine, states.keys = e, e.store.keys(p)
    e.generate([p], 1)
    assert states.held_at_put and set(states.held_at_put) == {0}


def test_a_window_of_256_reuses_exactly_and_replays_from_position_0_at_most(
    tmp_path: Path, cluster_file: Path, engine: MakeEngine
) -> None:
    wide = make_checkpoint(tmp_path / "w256", "tiny", seed=1, sliding_window=256)
    p = prompt(1200, seed=14)
    producer = engine(wide, cluster_file)
    cold, warm = producer.generate([p], 8)[0], producer.generate([p], 8)[0]
    plain = producer.generate([p], 8, reuse=False)[0]
    assert (cold.hit_tokens, warm.hit_tokens, warm.replayed) == (0, 896, False)  # ≤ 1200 − 262, multiple of 128
    assert warm.tokens == plain.tokens
    assert (warm.first_logits - plain.first_logits).abs().max().item() <= TOLERANCE
    short = p[:400]  # hit 128 < W: replay runs positions 0…127, all the hit, which is exact
    replayed = engine(wide, cluster_file, LocalStateBlocks()).generate([short], 8)[0]
    alone = producer.generate([short], 8, reuse=False)[0]
    assert (replayed.hit_tokens, replayed.replayed) == (128, True)
    assert replayed.tokens == alone.tokens
    assert (replayed.first_logits - alone.first_logits).abs().max().item() <= TOLERANCE


def test_a_directory_address_without_a_port_is_one_clear_error(checkpoint: Path, cluster_file: Path) -> None:
    with pytest.raises(ValueError, match="bad address 'dirhost': use HOST:PORT"):
        Engine.from_pretrained(checkpoint, store=cluster_file, directory="dirhost")


def test_a_store_that_is_down_means_recompute(checkpoint: Path, tmp_path: Path, engine: MakeEngine) -> None:
    dead = cluster_mod.write_default(tmp_path / "dead", nodes=12)  # nodes never started
    p = prompt(600, seed=7)
    result = engine(checkpoint, dead).generate([p, p], 8)
    assert [r.hit_tokens for r in result] == [0, 0]
    assert result[0].tokens == result[1].tokens == engine(checkpoint, None).generate([p], 8)[0].tokens


@pytest.mark.parametrize(("slot_sizes", "seed"), [("64KiB", 8), ("16KiB,64KiB", 20)])  # pages are 32 KiB
def test_reuse_through_the_fetcher_process_is_exact(
    checkpoint: Path, cluster_file: Path, tmp_path: Path, slot_sizes: str, seed: int, engine: MakeEngine
) -> None:
    states = LocalStateBlocks()
    shm = f"kvt-engine-{secrets.token_hex(6)}"
    with LocalFetcher(cluster_file, shm, tmp_path / "fetcher.sock", "8MiB", slot_sizes) as fetcher:
        e = engine(checkpoint, cluster_file, states, fetcher=fetcher.socket_path)
        p = prompt(1500, seed=seed)
        cold, warm = e.generate([p], 16)[0], e.generate([p], 16)[0]
        longer = p + prompt(300, seed=seed + 2)
        e.generate([longer], 1)  # puts blocks 23… of the chain: a later turn must find them
        later = e.generate([longer + prompt(300, seed=seed + 3)], 1)[0]
        fetched = e.transfer.client.stats()
    assert (cold.hit_tokens, warm.hit_tokens, warm.replayed, later.hit_tokens) == (0, 1280, False, 1792)
    assert warm.tokens == cold.tokens == e.generate([p], 16, reuse=False)[0].tokens
    assert fetched["hits"] > 0  # put through the fetcher's pool, read back from it


def test_a_model_without_sliding_layers_reuses_up_to_the_last_block(
    tmp_path: Path, cluster_file: Path, engine: MakeEngine
) -> None:
    path = make_checkpoint(tmp_path / "llama", "tiny", seed=0, layer_types="full", family="llama")
    e = engine(path, cluster_file)
    p = prompt(641, seed=9)
    cold, warm = e.generate([p], 8)[0], e.generate([p], 8)[0]
    assert (warm.hit_tokens, warm.replayed) == (640, False)
    assert warm.tokens == cold.tokens
    assert (warm.first_logits - cold.first_logits).abs().max().item() <= TOLERANCE


# -- the benchmarks that drive the engine (what they report, not how fast) ---------------------------------


def test_kvbench_ttft_reports_each_hit_ratio_with_its_bound_and_the_raw_stream_beside_its_read(
    cluster_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = ["ttft", "--prompt-tokens", "300", "--hits", "0,50", "--repeats", "1", "--json"]
    args = ["--config", str(cluster_file), *bench]
    assert kvbench(args) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["hit_tokens"] for p in points] == [0, 128]
    assert all(p["bound_s"] > 0 and p["speedup"] > 0 for p in points)
    assert [p["raw_stream_bytes_per_s"] is None for p in points] == [True, False]  # no hit, nothing to carry
    assert points[1]["raw_stream_bytes_per_s"] > 0


def test_kvbench_ttft_through_the_fetcher_reports_the_cold_store_hit_and_the_warm_pool_hit(
    cluster_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = ["ttft", "--prompt-tokens", "300", "--hits", "50", "--repeats", "1", "--through", "fetcher", "--json"]
    assert kvbench(["--config", str(cluster_file), *bench]) == 0
    [point] = json.loads(capsys.readouterr().out)["points"]
    assert point["hit_tokens"] == 128 and point["ttft_cold_s"] > 0 and point["ttft_reuse_s"] > 0
    assert point["link_bytes_per_s"] > 0 and point["link_bound_s"] >= point["compute_s"] and point["vs_link"] > 0


def test_kvbench_swa_replay_reports_the_error_of_replayed_prefills(
    cluster_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--config", str(cluster_file), "swa-replay", "--prompts", "2", "--new-tokens", "4", "--json"]
    assert kvbench([*args, "--lengths", "700-900", "--seed", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["prompt_tokens"] for r in result["prompts"]] == [700, 900]
    assert result["settings"]["seed"] == 3 and result["settings"]["checkpoint"] == "preset tiny seed 3"
    assert [r["hit_tokens"] > 0 for r in result["prompts"]] == [True, True]
    assert 0 <= result["token_agreement"] <= 1 and result["max_abs_dlogit_max"] >= result["max_abs_dlogit_median"]
    for r in result["prompts"]:  # a near tie: the exact run's top two are closer than the error can move them
        assert r["near_tie"] == (r["top2_margin"] < 2 * r["max_abs_dlogit"])
        assert (r["margin_at_divergence"] is None) == (r["common_prefix"] == 4)
    assert result["near_ties"] == sum(r["near_tie"] for r in result["prompts"])
    assert result["diverged"] == sum(r["common_prefix"] < 4 for r in result["prompts"])
