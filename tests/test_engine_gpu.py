"""The engine's GPU paths against its CPU ones (run on a machine with CUDA; `dev/gpu_ttft.py` runs them there)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.engine.checkpoint import make_checkpoint
from kvtier.engine.engine import Engine, Result
from kvtier.engine.model import attention, causal_attention
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.transfer.fetch_client import FetchClient
from kvtier.transfer.fetcher import LocalFetcher

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref.double()).norm() / ref.double().norm()).item()


def qkv(t: int, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t * 7 + s)
    k, v = (torch.randn(s, 8, 128, generator=g) for _ in range(2))
    return torch.randn(t, 32, 128, generator=g), k, v


@pytest.mark.parametrize(("t", "s"), [(512, 512), (512, 3000), (1, 3000)])
def test_causal_attention_in_bf16_on_the_gpu_equals_the_masked_reference(t: int, s: int) -> None:
    q, k, v = qkv(t, s)
    ref = attention(q, k, v, torch.arange(s - t, s), torch.arange(s), None)
    out = causal_attention(*(x.cuda().bfloat16() for x in (q, k, v)))
    assert relative_error(out, ref) < 1e-2


def test_sliding_attention_on_the_gpu_equals_the_cpu() -> None:
    q, k, v = qkv(512, 646)
    q_pos, k_pos = torch.arange(1134, 1646), torch.arange(1000, 1646)
    ref = attention(q, k, v, q_pos, k_pos, 128)
    out = attention(*(x.cuda().bfloat16() for x in (q, k, v)), q_pos.cuda(), k_pos.cuda(), 128)
    assert relative_error(out, ref) < 1e-2


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = cluster_mod.write_default(tmp_path_factory.mktemp("cluster"), capacity_bytes=64 << 20, metrics=False)
    with LocalCluster(path) as local:
        yield local.config_path


def warm_cold_and_cpu(checkpoint: Path, cluster_file: Path, seed: int) -> tuple[Result, Result, Result]:
    """A 1,500-token prompt on the GPU reusing its first 1,024 tokens (warm) and computed whole (cold), and on the
    CPU; 8 greedy tokens each."""
    prompt = torch.randint(0, 512, (1500,), generator=torch.Generator().manual_seed(seed)).tolist()
    gpu = Engine.from_pretrained(checkpoint, device="cuda", store=cluster_file, cache_tokens=8192)
    cpu = Engine.from_pretrained(checkpoint, cache_tokens=8192)
    gpu.generate([prompt[:1024]], 1)
    warm, cold = gpu.generate([prompt], 8)[0], gpu.generate([prompt], 8, reuse=False)[0]
    ref = cpu.generate([prompt], 8)[0]
    assert (warm.hit_tokens, warm.replayed) == (1024, False)
    assert (warm.first_logits - cold.first_logits).abs().max().item() <= 1e-3
    assert (warm.first_logits.cpu() - ref.first_logits).abs().max().item() <= 1e-3
    return warm, cold, ref


def test_reuse_on_the_gpu_is_exact_and_agrees_with_the_cpu(tmp_path: Path, cluster_file: Path) -> None:
    warm, cold, ref = warm_cold_and_cpu(make_checkpoint(tmp_path / "tiny", "tiny", seed=0), cluster_file, 3)
    assert warm.tokens == cold.tokens == ref.tokens


def test_deepseek_v4_on_the_gpu_reuses_exactly_and_agrees_with_the_cpu(tmp_path: Path, cluster_file: Path) -> None:
    """The GPU's V4 attention (windows gathered, index scores a slice of queries at a time) against the CPU's,
    which is transformers' to the bit; reuse through the store exact on the GPU."""
    warm, cold, _ = warm_cold_and_cpu(make_checkpoint(tmp_path / "v4", "v4-tiny", seed=0), cluster_file, 4)
    assert warm.tokens == cold.tokens  # (the CPU's may part from them at a near tie: seen at the 5th token)


def test_batched_decode_on_the_gpu_reads_the_pages_in_place_and_gives_each_sequence_its_logits_alone(
    tmp_path: Path,
) -> None:
    from kvtier.engine import paged_attention
    from tests.test_engine_batching import lockstep, prompt

    assert paged_attention.available  # Triton ships with CUDA builds of torch
    engine = Engine.from_pretrained(make_checkpoint(tmp_path / "tiny", "tiny", seed=0), device="cuda")
    lockstep(engine, [prompt(300, 1), prompt(700, 2), prompt(40, 3)], {3: prompt(900, 4)}, 7, tolerance=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("through", ["client", "fetcher"])
def test_a_prefix_in_a_kv_format_lands_decoded_on_the_gpu_bit_for_bit(
    tmp_path: Path, cluster_file: Path, dtype: torch.dtype, through: str
) -> None:
    """The decoding swap-in (the pinned staging rows of a store read, or the fetcher's slots) puts in each page what
    the torch reference decodes from the block the store holds."""
    checkpoint = make_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    e = Engine.from_pretrained(checkpoint, "cuda", dtype, store=cluster_file, cache_tokens=8192, kv_format="seed")
    prompt = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(len(through))).tolist()
    e.generate([prompt[:900]], 1)
    assert e.store is not None
    keys = e.store.keys(prompt)[:12]
    stored = torch.zeros(12, e.block_bytes, dtype=torch.uint8)
    assert e.store.get_into(keys, [memoryview(row.numpy()) for row in stored], prompt) == 12
    want = e.block_format.decode(stored)  # the torch reference, on the CPU
    with contextlib.ExitStack() as stack:
        if through == "fetcher":
            shm = f"kvt-gpu-{secrets.token_hex(4)}"
            fetcher = stack.enter_context(LocalFetcher(cluster_file, shm, tmp_path / "f.sock", "64MiB"))
            e.attach_store(e.store, FetchClient(fetcher.socket_path, e.store.client.config.token))
        g = stack.enter_context(e.start(prompt, 1))
        g.step()  # the lookup and the fetch: 768 tokens, 12 blocks decoded into their pages
        assert g.seq.hit_tokens == 768
        got = e.cache.pages[g.seq.pages[:12]].reshape(12, -1).view(torch.uint8).cpu()
    assert torch.equal(got, want)
