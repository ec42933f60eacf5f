"""Continuous batching: many sequences in one forward give each the logits it gets alone (fp32, within 1e-5),
the same greedy and seeded tokens, the same reuse and P/D answers; pages are taken as tokens are computed, and
when they run out requests are preempted and resumed (by refetch or recompute), never failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine.checkpoint import make_checkpoint
from kvtier.engine.engine import Engine, Generation
from kvtier.engine.model import attention
from kvtier.engine.sampling import Sampling
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.stateblocks import LocalStateBlocks
from kvtier.engine.worker import WorkerLoop
from kvtier.serving.cost import CostModel

BATCHED_TOLERANCE = 1e-5
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, requests: list[dict[str, Any]], role: str = "both", **kw: Any) -> dict[Any, dict[str, Any]]:
    """Every request through one worker loop at once; the answer of each, by id."""
    events: list[dict[str, Any]] = []
    loop = WorkerLoop(engine, role, events.append, **kw)
    for r in requests:
        loop.submit(r)
    loop.submit(None)
    loop.run()
    return {e["id"]: e for e in events if "token" not in e}


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("v4") / "tiny", "v4-tiny", seed=0)


@pytest.fixture(scope="module")
def cluster_file(make_cluster) -> Path:
    return make_cluster(capacity_bytes=64 << 20).config_path


# -- one forward for many sequences -------------------------------------------------------------------------------


def lockstep(
    engine: Engine,
    prompts: list[list[int]],
    joins: dict[int, list[int]],
    steps: int,
    tolerance: float = BATCHED_TOLERANCE,
) -> None:
    """Run ``prompts`` batched (plus ``joins[i]`` arriving at step ``i``, prefilled beside the others' decode
    tokens) and each of them alone on the same engine, step by step: every step's logits of a sequence in the
    batch within ``tolerance`` of its own alone, and the same tokens."""
    batched: list[Generation] = []
    alone: list[Generation] = []
    try:
        for i in range(steps):
            for p in ([*prompts] if i == 0 else []) + ([joins[i]] if i in joins else []):
                batched.append(engine.start(p, steps))
                alone.append(engine.start(p, steps))
            live = [j for j, g in enumerate(batched) if not g.finish_reason]
            works = [batched[j].work() for j in live]
            rows = engine.runner.forward(works)
            for j, row in zip(live, rows, strict=True):
                expected = engine.runner.forward([alone[j].work()])[0]
                assert (row - expected).abs().max().item() <= tolerance, f"sequence {j}, step {i}"
                assert batched[j].take(row) == alone[j].take(expected)
    finally:
        for g in batched + alone:
            g.close()


def test_each_dense_sequence_in_a_batched_step_gets_the_logits_it_gets_alone(checkpoint: Path) -> None:
    """Decode tokens of sequences of different lengths (pages gathered into one padded batch), a prompt of two
    chunks joining them (its second chunk a forward of its own), sliding and global layers."""
    engine = Engine.from_pretrained(checkpoint, cache_tokens=16384)
    lockstep(engine, [prompt(300, 1), prompt(700, 2), prompt(40, 3)], {3: prompt(900, 4), 5: prompt(64, 5)}, 9)


def test_each_v4_sequence_in_a_batched_step_gets_the_logits_it_gets_alone(v4: Path) -> None:
    """DeepSeek-V4: projections, hyper-connections and experts once over the batch; each sequence's window,
    compressors, indexer and score rows with its own state, as alone."""
    engine = Engine.from_pretrained(v4, cache_tokens=16384, chunk_tokens=256)
    lockstep(engine, [prompt(300, 1), prompt(700, 2), prompt(40, 3)], {3: prompt(600, 4)}, 7)


# -- the same answers in a worker -----------------------------------------------------------------------------------


SEEDED = {"temperature": 0.9, "seed": 7, "top_k": 50, "repetition_penalty": 1.1}


def test_seeded_sampling_in_a_batch_equals_each_request_alone(checkpoint: Path) -> None:
    engine = Engine.from_pretrained(checkpoint)
    prompts = {i: prompt(100 + 150 * i, 10 + i) for i in range(4)}
    answers = run(engine, [{"id": i, "prompt": p, "max_new_tokens": 12, **SEEDED} for i, p in prompts.items()])
    sampling = Sampling(temperature=0.9, seed=7, top_k=50, repetition_penalty=1.1)
    for i, p in prompts.items():
        assert answers[i]["tokens"] == engine.generate([p], 12, reuse=False, sampling=sampling)[0].tokens


def test_v4_requests_batched_in_a_worker_answer_as_alone_and_as_transformers(v4: Path) -> None:
    transformers = pytest.importorskip("transformers")
    engine = Engine.from_pretrained(v4, chunk_tokens=256)
    prompts = {i: prompt(n, 20 + i) for i, n in enumerate((700, 90, 400))}
    answers = run(engine, [{"id": i, "prompt": p, "max_new_tokens": 8, "logprobs": 1} for i, p in prompts.items()])
    hf = transformers.AutoModelForCausalLM.from_pretrained(v4, dtype=torch.float32, attn_implementation="eager")
    for i, p in prompts.items():
        with torch.no_grad():
            expected = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
        assert answers[i]["tokens"] == engine.generate([p], 8)[0].tokens
        assert answers[i]["tokens"][: len(expected)] == expected  # (transformers stops at the checkpoint's EOS)


# -- pages on demand, preemption ------------------------------------------------------------------------------------


def with_context(checkpoint: Path, out: Path, context: int) -> Path:
    """``checkpoint`` with a context of ``context`` tokens (its weights linked, not copied)."""
    out.mkdir()
    raw = json.loads((checkpoint / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": context}))
    for f in checkpoint.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    return out


def burst(engine: Engine, prompts: list[list[int]], **kw: Any) -> tuple[dict[Any, dict[str, Any]], Scheduler]:
    """Chats without max_tokens (the server asks for the rest of the context) all at once through one worker."""
    events: list[dict[str, Any]] = []
    loop = WorkerLoop(engine, "both", events.append, **kw)
    for i, p in enumerate(prompts):
        loop.submit({"id": i, "prompt": p, "max_new_tokens": engine.config.max_position_embeddings - len(p)})
    loop.submit(None)
    loop.run()
    return {e["id"]: e for e in events}, loop.scheduler


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def test_a_burst_of_chats_longer_than_the_cache_is_served_by_preempting_never_failing(
    checkpoint: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    """A context of 768 tokens and a cache of 512: each chat could fill the cache alone. Every one is answered
    (none fails for lack of pages: each was refused before); requests admitted later are preempted while earlier
    ones grow and resume by recomputing (no store), their tokens those of the request alone."""
    engines.append(Engine.from_pretrained(with_context(checkpoint, tmp_path / "ck", 768), cache_tokens=512))
    prompts = [prompt(100 + 50 * i, 30 + i) for i in range(4)]
    answers, scheduler = burst(engines[0], prompts)
    assert all("tokens" in answers[i] for i in range(4)), answers
    assert scheduler.preemptions > 0 and scheduler.refetches == 0
    for i, p in enumerate(prompts):
        tokens = answers[i]["tokens"]
        assert len(p) + len(tokens) <= 513 and answers[i]["finish_reason"] in ("length", "stop")
        assert tokens == engines[0].generate([p], len(tokens), reuse=False)[0].tokens
    assert engines[0].cache.free_pages == engines[0].cache.num_pages


@pytest.mark.parametrize(("family", "store_thread"), [("dense", False), ("dense", True), ("v4", False)])
def test_a_preempted_request_resumes_from_the_stores_blocks_exactly(
    family: str,
    store_thread: bool,
    checkpoint: Path,
    v4: Path,
    cluster_file: Path,
    tmp_path: Path,
    engines: list[Engine],
) -> None:
    """With a store, a preempted request publishes what it computed and resumes by fetching it (no cost model:
    always), StateBlock and all: the same tokens as alone; with the store's calls on their thread too (the
    publish and the resume's fetch run there, the pages come back when the publish has read them)."""
    source, context, n = (checkpoint, 768, 3) if family == "dense" else (v4, 640, 2)
    ck = with_context(source, tmp_path / "ck", context)
    states = LocalStateBlocks()
    engines.append(Engine.from_pretrained(ck, store=cluster_file, state_blocks=states, cache_tokens=512))
    prompts = [prompt(150 + 40 * i, 40 + i + 10 * store_thread) for i in range(n)]
    answers, scheduler = burst(engines[0], prompts, store_timeout_s=30.0 if store_thread else None)
    assert scheduler.refetches > 0
    alone = Engine.from_pretrained(ck, cache_tokens=context)
    for i, p in enumerate(prompts):
        tokens = answers[i]["tokens"]
        assert tokens == alone.generate([p], len(tokens), reuse=False)[0].tokens
    assert engines[0].cache.free_pages == engines[0].cache.num_pages


# -- the GPU's decode kernel, interpreted on the CPU -----------------------------------------------------------------


def test_the_gpu_decode_kernel_reads_each_sequences_pages_in_place_as_the_gathered_attention_does() -> None:
    """The Triton kernel run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` is read when Triton is
    imported: a process of its own), against :func:`attention` over each sequence's keys gathered."""
    pytest.importorskip("triton")
    run = "from tests.test_engine_batching import decode_kernel_error; print(decode_kernel_error())"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", run], cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) <= BATCHED_TOLERANCE


def decode_kernel_error() -> float:
    """Three sequences of 1, 130 and 300 positions whose pages lie anywhere in the cache, one global layer of
    several (its K and V strided views of the pages), four query heads per kv head: the kernel's largest
    difference from the gathered attention."""
    from kvtier.engine.paged_attention import paged_decode

    gen = torch.Generator().manual_seed(0)
    pages = torch.randn(12, 2, 2, 64, 2, 16, generator=gen)  # [page][global layer][K|V][token][kv head][dim]
    tables = [torch.tensor([7]), torch.tensor([3, 11, 0]), torch.tensor([5, 1, 9, 2, 10])]
    lengths = torch.tensor([1, 130, 300])
    q = torch.randn(3, 8, 16, generator=gen)
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    out = paged_decode(q, pages[:, 1, 0], pages[:, 1, 1], padded, lengths)
    worst = 0.0
    for b, (table, n) in enumerate(zip(tables, lengths.tolist(), strict=True)):
        k, v = (pages[table, 1, i].flatten(0, 1)[:n] for i in (0, 1))  # [n, kv heads, dim]
        expected = attention(q[b : b + 1], k, v, torch.tensor([n - 1]), torch.arange(n), None)[0]
        worst = max(worst, (out[b] - expected).abs().max().item())
    return worst


def test_kvbench_decode_reports_each_concurrencys_tokens_itl_and_roofline_and_prefill_beside_decode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvtier.tools.kvbench import main as kvbench

    argv = ["decode", "--context", "100", "--concurrency", "1,3", "--steps", "2", "--mixed", "2", "--json"]
    assert kvbench(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert [p["concurrency"] for p in result["points"]] == [1, 3] and result["copy_bandwidth_gb_s"] > 0
    for p in result["points"]:
        assert p["tokens_s"] > 0 and p["itl_s"] > 0 and 0 < p["roofline_fraction"] < 1
    assert result["points"][1]["kv_read_bytes"] > 2 * result["points"][0]["kv_read_bytes"]
    assert result["mixed"]["prefill_tokens_s"] > 0 and result["mixed"]["decoding"] == 2


def test_a_preempted_request_refetches_when_the_cost_model_says_computing_costs_more_than_fetching(
    checkpoint: Path, cluster_file: Path, engines: list[Engine]
) -> None:
    """The refetch-or-recompute rule: ``fetch(bytes) + t(n − h, h) < t(n, 0)``, the fetch at the rate this
    engine's own fetches ran (one measured here)."""
    engines.append(Engine.from_pretrained(checkpoint, store=cluster_file))
    engine = engines[0]
    p = prompt(700, 60)
    engine.generate([p], 1)
    engine.generate([p], 1)  # a reuse: its fetch measured
    assert engine.fetch_s > 0 and engine.fetched_bytes > 0
    g = engine.start(prompt(700, 61), 100)
    for _ in range(3):
        g.step()
    assert g.restorable_blocks == 10  # 702 positions computed, 10 full blocks published at a preemption
    cheap, dear = CostModel(0.0, 1e-12, 0.0), CostModel(0.0, 1.0, 0.0)  # a token's compute: ~free, or a second
    assert not Scheduler(engine, cheap).refetch_pays(g) and Scheduler(engine, dear).refetch_pays(g)
    assert Scheduler(engine).refetch_pays(g)  # no cost model: the store's copy
    g.close()
