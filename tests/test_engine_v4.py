"""DeepSeek-V4 in the engine: transformers' logits on checkpoints transformers wrote, compressed block KV in the
store, windows and accumulators in StateBlocks, reuse exact end to end."""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine.checkpoint import load, make_checkpoint
from kvtier.engine.config import UnsupportedModelError
from kvtier.engine.deepseek_v4.family import DEEPSEEK_V4, V4Pages
from kvtier.engine.deepseek_v4.state import DenseEntries, V4State, state_block_bytes
from kvtier.engine.dense import forward_logits
from kvtier.engine.engine import Engine
from kvtier.engine.reuse import Reuse, plan
from kvtier.engine.stateblocks import LocalStateBlocks
from kvtier.engine.worker import WorkerProcess
from kvtier.transfer.fetcher import LocalFetcher

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def transformers_checkpoint(out: Path, seed: int, **fields: Any) -> Path:
    """A checkpoint written by transformers' own ``save_pretrained`` (DeepSeek's tensor names), every parameter and
    buffer drawn at random (transformers initialises many to 0 or 1, which would hide a missed load)."""
    base: dict[str, Any] = dict(
        vocab_size=300,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=48,
        num_experts_per_tok=2,
        n_routed_experts=4,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=64,
        sliding_window=128,
        max_position_embeddings=8192,
    )
    config = transformers.DeepseekV4Config(**{**base, **fields})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, config.n_routed_experts, b.shape))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(out)
    return out


def reference_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


MIXES = {
    # every attention kind, hash and top-k MoE, an indexer that keeps more than 1,100 tokens pool (275) and less
    "every-kind": dict(
        layer_types=[HCA, CSA, SLIDING, CSA, HCA],
        mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe", "moe"],
        hc_mult=2,
    ),
    # one indexer head (scores tie at exactly 0 often), a small window and HCA rate, legacy fields, flat yarn RoPE
    "ties-legacy": dict(
        compress_ratios=[4, 0, 4, 128, 4],
        num_hash_layers=1,
        compress_rate_hca=16,
        index_n_heads=1,
        index_topk=8,
        sliding_window=16,
        hc_mult=3,
        partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    ),
    # transformers' default mix, four streams, sigmoid routing, a wider indexer that chooses
    "default-mix": dict(num_hidden_layers=6, hc_mult=4, scoring_func="sigmoid", index_topk=32, index_n_heads=8),
}


@pytest.fixture(scope="module", params=sorted(MIXES))
def hf_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return transformers_checkpoint(tmp_path_factory.mktemp("hf") / request.param, 7, **MIXES[request.param])


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The v4-tiny checkpoint, written once per module."""
    return make_checkpoint(tmp_path_factory.mktemp("v4") / "tiny", "v4-tiny", seed=0)


# -- the model ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [5, 1100])
def test_logits_equal_transformers_on_checkpoints_transformers_wrote(hf_checkpoint: Path, length: int) -> None:
    tokens = prompt(length, seed=length, vocab=300)
    ours = forward_logits(load(hf_checkpoint), torch.tensor(tokens), chunk_tokens=512)
    assert (ours - reference_logits(hf_checkpoint, tokens)).abs().max().item() <= TOLERANCE


def test_the_v4_tiny_preset_loads_in_transformers_with_the_same_logits(v4: Path) -> None:
    tokens = prompt(1300, seed=3)
    ours = forward_logits(load(v4), torch.tensor(tokens), chunk_tokens=512)
    assert (ours - reference_logits(v4, tokens)).abs().max().item() <= TOLERANCE


def test_the_cpu_reference_forward_is_bitwise_transformers_and_ignores_chunking(tmp_path: Path) -> None:
    """On the CPU the reference forward runs the whole prompt as transformers does, row for row: equal logits to
    the bit, so where an indexer's scores tie exactly (one indexer head: ReLU zeros) the tie falls the same way."""
    path = transformers_checkpoint(tmp_path / "ties", 11, **MIXES["ties-legacy"])
    tokens = prompt(900, seed=5, vocab=300)
    model = load(path)
    assert torch.equal(forward_logits(model, torch.tensor(tokens), chunk_tokens=128), reference_logits(path, tokens))


def test_each_prompt_query_chooses_among_the_whole_prompts_entries_however_the_engine_chunks_it(tmp_path: Path) -> None:
    """The indexer's top-k of a prompt query is taken over a row of as many scores as the whole prompt pools, those
    after the query's window ``-inf``: what it may choose never depends on the chunking, and exact ties fall as in the
    whole-prompt forward (with the row as long as the query's own pool, the ties below fell elsewhere: 2.5 off)."""
    path = transformers_checkpoint(tmp_path / "ties", 11, **MIXES["ties-legacy"])
    tokens = prompt(900, seed=5, vocab=300)
    expected = reference_logits(path, tokens)[-1]
    for chunk in (128, 256, 1024):
        with Engine.from_pretrained(path, chunk_tokens=chunk) as engine:
            [result] = engine.generate([tokens], 0)
        assert (result.first_logits - expected).abs().max().item() <= TOLERANCE


def test_the_gpu_attention_layout_computes_what_the_cpu_one_does(v4: Path) -> None:
    """The GPU's attention (each query's window gathered, no row over the prompt) against the CPU's rows."""
    model = load(v4)
    attention = next(layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is not None)
    gen = torch.Generator().manual_seed(0)
    t, heads, dim = 300, model.config.num_heads, model.config.head_dim
    q, keys = torch.randn(t, heads, dim, generator=gen), torch.randn(t + 10, dim, generator=gen)
    positions = torch.arange(500, 500 + t)
    entries = torch.randn(200, dim, generator=gen)
    chosen = torch.stack([torch.randperm(200, generator=gen)[:16] for _ in range(t)])  # distinct, as top-k's
    chosen[:, -3:] = -1  # fewer to choose from than k
    for picks in (None, chosen):
        rows = attention._attend_rows(q, keys, 490, positions, entries, picks, 1000)
        gathered = attention._attend(q, keys, 490, positions, entries, picks)
        assert (rows - gathered).abs().max().item() <= 1e-5


def test_greedy_decoding_over_the_engines_caches_equals_transformers_generate(v4: Path) -> None:
    p = prompt(700, seed=8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(v4, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
    with Engine.from_pretrained(v4, chunk_tokens=256) as engine:
        [result] = engine.generate([p], 12)
    assert result.tokens == expected
    assert (result.first_logits - reference_logits(v4, p)[-1]).abs().max().item() <= TOLERANCE


# -- what a block and a StateBlock hold ----------------------------------------------------------------------------


def test_a_block_holds_each_compressors_entries_of_its_positions_and_nothing_of_the_window(v4: Path) -> None:
    model = load(v4)
    config = model.config
    block = DEEPSEEK_V4.block_tokens(config, None)
    pages = V4Pages(config, 4, block, torch.float32, torch.device("cpu"))
    per_block = {name: (per, width) for name, (_, per, width) in pages.parts.items()}
    assert pages.page_bytes == 4 * sum(n * w for n, w in per_block.values())
    assert per_block[(1, "compressor")] == (block // 4, config.head_dim)  # CSA: one entry per 4 positions
    assert per_block[(1, "indexer")] == (block // 4, config.index_head_dim)  # and its indexer keys
    assert per_block[(0, "compressor")] == (block // 128, config.head_dim)  # HCA: one per 128
    assert (2, "compressor") not in per_block  # a sliding-only layer stores nothing
    with Engine.from_pretrained(v4) as engine:
        tokens = prompt(3 * block + 5, seed=2)
        seq = engine.start(tokens, 0)
        seq.step()
        reference = V4State(config, DenseEntries())
        forward_logits_into(model, tokens, reference)
        for name, (offset, per, width) in pages.parts.items():
            for b, page in enumerate(seq.seq.pages[:3]):
                stored = engine.cache.pages[page, offset : offset + per * width].view(per, width)
                assert torch.equal(stored, reference.store.held[name][b * per : (b + 1) * per])
        seq.close()


def forward_logits_into(model: torch.nn.Module, tokens: list[int], state: V4State) -> None:
    """A whole forward of ``tokens`` with ``state`` as its context (contiguous entries kept in it)."""
    with torch.inference_mode():
        state.begin((0, len(tokens)), len(tokens), True, [])
        model(torch.tensor(tokens), state.positions, state)


def test_a_state_block_cut_mid_chunk_resumes_the_sequence_exactly(v4: Path) -> None:
    """A StateBlock at 256, cut while a 512-token chunk ran past it, restores a state from which the rest of the
    prompt computes the same logits as the uninterrupted forward."""
    model, tokens = load(v4), prompt(600, seed=4)
    config = model.config
    whole = V4State(config, DenseEntries())
    with torch.inference_mode():
        whole.begin((0, 512), 600, True, [256])
        model(torch.tensor(tokens[:512]), whole.positions, whole)
        data = whole.state_block(256)
        assert data.numel() == state_block_bytes(config, torch.float32)
        entries = DenseEntries()  # the block KV of prefix[:256]
        entries.held = {name: e[: 256 // config.rate(name[0])] for name, e in whole.store.held.items()}
        resumed = V4State.from_state_block(config, entries, data, 256, torch.float32, "cpu")
        resumed.begin((256, 600), 600, True, [])
        tail = model.logits(model(torch.tensor(tokens[256:]), resumed.positions, resumed))
    expected = forward_logits(model, torch.tensor(tokens), chunk_tokens=1024)[256:]
    assert (tail - expected).abs().max().item() <= TOLERANCE


def test_the_hit_leaves_only_the_last_token_and_falls_on_block_boundaries() -> None:
    exact = plan(1000, 1000, 128, 128, lambda h: True, margin=1)
    assert (exact.hit_tokens, exact.reuse) == (896, Reuse.EXACT)
    assert plan(1025, 1024, 128, 128, lambda h: True, margin=1).hit_tokens == 1024
    assert plan(1024, 1024, 128, 128, lambda h: True, margin=1).hit_tokens == 896  # the last token is computed
    assert plan(1000, 1000, 128, 128, lambda h: False, margin=1).reuse is Reuse.REPLAY


# -- reuse through the store ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_file(make_cluster) -> Path:
    return make_cluster(capacity_bytes=64 << 20).config_path


def test_a_warm_run_reuses_the_compressed_blocks_and_the_state_block_exactly(
    v4: Path, cluster_file: Path, engine: Callable[..., Engine]
) -> None:
    e = engine(v4, cluster_file, LocalStateBlocks())
    p = prompt(1000, seed=21)
    [cold] = e.generate([p], 12, reuse=False)
    [first] = e.generate([p], 12)
    [warm] = e.generate([p], 12)
    assert first.hit_tokens == 0 and (warm.hit_tokens, warm.replayed) == (896, False)
    assert warm.tokens == cold.tokens == first.tokens
    assert (warm.first_logits - cold.first_logits).abs().max().item() <= TOLERANCE


def test_the_next_turn_reuses_the_prompt_and_the_answer(
    v4: Path, cluster_file: Path, engine: Callable[..., Engine]
) -> None:
    e = engine(v4, cluster_file, LocalStateBlocks())
    p = prompt(700, seed=22)
    [turn] = e.generate([p], 100)
    nxt = p + turn.tokens + prompt(200, seed=23)
    [warm] = e.generate([nxt], 8)
    [plain] = e.generate([nxt], 8, reuse=False)
    assert warm.hit_tokens == 768 and not warm.replayed  # 799 positions were computed: 6 blocks
    assert warm.tokens == plain.tokens


def test_block_kv_without_its_state_block_is_a_bounded_replay_that_stores_nothing(
    v4: Path, cluster_file: Path, engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    p = prompt(1100, seed=24)
    engine(v4, cluster_file, LocalStateBlocks()).generate([p], 4)  # blocks in the store, its StateBlocks elsewhere
    e = engine(v4, cluster_file, LocalStateBlocks())
    q = p + prompt(300, seed=25)
    with caplog.at_level("INFO", logger="kvtier.engine"):
        [replayed] = e.generate([q], 4)
    assert (replayed.hit_tokens, replayed.replayed) == (1024, True)
    said = [r.getMessage() for r in caplog.records if "no StateBlock" in r.getMessage()]
    assert said == ["no StateBlock at position 1024 of a 1400-token prompt: bounded replay of positions 896-1023 "
                    "(approximate; nothing of this request is stored)"]  # fmt: skip
    [after] = e.generate([q + prompt(200, seed=29)], 4)
    assert after.hit_tokens == 1024  # nothing of the replayed request was stored (its blocks would reach 1,280)


def test_an_engine_of_another_block_size_or_dtype_never_reads_these_blocks(
    v4: Path, cluster_file: Path, engine: Callable[..., Engine]
) -> None:
    p = prompt(800, seed=26)
    engine(v4, cluster_file, LocalStateBlocks()).generate([p], 2)
    assert engine(v4, cluster_file, LocalStateBlocks(), block_tokens=256).generate([p], 2)[0].hit_tokens == 0
    other = engine(v4, cluster_file, LocalStateBlocks())
    assert other.namespace != Engine.from_pretrained(v4, dtype=torch.float64).namespace


def test_reuse_through_the_fetcher_process_is_exact(
    v4: Path, cluster_file: Path, engine: Callable[..., Engine], tmp_path: Path
) -> None:
    shm = f"kvt-v4-{secrets.token_hex(4)}"
    with LocalFetcher(cluster_file, shm, tmp_path / "fetch.sock", "8MiB") as fetcher:
        e = engine(v4, cluster_file, LocalStateBlocks(), fetcher=fetcher.socket_path)
        p = prompt(1000, seed=27)
        [cold] = e.generate([p], 8, reuse=False)
        e.generate([p], 8)
        [warm] = e.generate([p], 8)
    assert (warm.hit_tokens, warm.replayed, warm.tokens) == (896, False, cold.tokens)


# -- P/D ------------------------------------------------------------------------------------------------------------


def test_a_decode_worker_resumes_from_block_kv_and_the_prefill_workers_state_block(
    v4: Path, cluster_file: Path
) -> None:
    argv = [sys.executable, "-m", "kvtier.transfer.directory", "--config", str(cluster_file), "--listen", "127.0.0.1:0"]
    directory = WorkerProcess(argv).wait_ready()
    address = directory.ready.split()[1]
    common = ["--checkpoint", str(v4), "--store", str(cluster_file), "--directory", address]
    prefill, decode = WorkerProcess.engine("prefill", *common), WorkerProcess.engine("decode", *common)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        p = prompt(1000, seed=28)
        stored = prefill.ask({"id": "a", "prompt": p})
        out = decode.ask({"id": "a", "prompt": p, "max_new_tokens": 16})
        alone = Engine.from_pretrained(v4).generate([p], 16)[0]
        assert (out["hit_tokens"], out["recomputed_tokens"], out["replayed"]) == (896, 104, False)
        assert out["tokens"] == alone.tokens and out["tokens"][0] == stored["first_token"]
    finally:
        for w in (prefill, decode):
            w.stop()
        directory.proc.terminate()
        directory.stop()


# -- what this engine refuses -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized weights"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types must list 5 entries"),
        ({"rope_parameters": {"main": {"rope_type": "llama3"}, "compress": {}}}, "rope type 'llama3'"),
        ({"num_attention_heads": 3}, "multiple of o_groups"),
    ],
)
def test_a_checkpoint_field_this_engine_does_not_support_is_one_clear_line(
    v4: Path, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    (tmp_path / "ck").mkdir()
    raw = json.loads((v4 / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**raw, **change}))
    (tmp_path / "ck" / "model.safetensors").symlink_to(v4 / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=message) as info:
        load(tmp_path / "ck")
    assert "\n" not in str(info.value)


def test_a_block_size_that_splits_a_compressed_entry_is_one_clear_line(v4: Path) -> None:
    with pytest.raises(ValueError, match="block_tokens must be a multiple of 128") as info:
        Engine.from_pretrained(v4, block_tokens=64)
    assert "\n" not in str(info.value)


def test_kvbench_kv_bytes_prints_block_bytes_per_token_beside_the_dense_8b(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.tools.kvbench import main as kvbench

    assert kvbench(["kv-bytes", "--models", "8b,v4-flash", "--kv-format", "exact", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    # V4-Flash in transformers' default mix: 20 CSA layers (32 entries of 512 + 32 indexer keys of 128 per 128
    # tokens) and 23 HCA layers (one entry of 512), bf16; the dense 8 B: 8 global layers of K and V, 8 heads of 128
    assert rows["v4-flash"]["block_bytes"] == (20 * 32 * (512 + 128) + 23 * 512) * 2
    assert rows["v4-flash"]["block_bytes_per_token"] == rows["v4-flash"]["block_bytes"] / 128
    assert rows["8b"]["block_bytes_per_token"] == 8 * 2 * 8 * 128 * 2


def test_the_gpu_index_scores_in_slices_equal_the_cpu_ones(v4: Path) -> None:
    indexer = next(layer.self_attn.indexer for layer in load(v4).model.layers if layer.self_attn.indexer is not None)
    indexer.SCORE_ELEMENTS = 1 << 12  # slices of a few queries
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(50, indexer.heads, indexer.head_dim, generator=gen)
    keys, weights = torch.randn(300, indexer.head_dim, generator=gen), torch.randn(50, indexer.heads, generator=gen)
    exact = indexer.scores(q, keys, weights, exact=True)
    assert (indexer.scores(q, keys, weights, exact=False) - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()


def test_kvtier_engine_serve_serves_a_v4_checkpoint_and_reports_its_reused_tokens(
    start_server, v4: Path, cluster_file: Path
) -> None:
    import openai

    url = start_server("--checkpoint", str(v4), "--store", str(cluster_file), "--model", "v4")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    ids = prompt(420, seed=30)  # the V4 hit rule reuses the last 128 boundary before the final token: 384
    first = client.completions.create(model="v4", prompt=ids, max_tokens=4, temperature=0)
    again = client.completions.create(model="v4", prompt=ids, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 384
    assert again.choices[0].text == first.choices[0].text
