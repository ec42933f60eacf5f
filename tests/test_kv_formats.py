"""KV formats in the engine (``engine/formats.py``): a format is part of every key (a block or StateBlock of another
format is a miss, never garbage), only the encoded bytes reach the store, the fetcher's pool and the StateBlock pool,
they decode the same whichever way they come back, and a format a model cannot take is one clear line. Real local
clusters and a real fetcher process; tiny dense and DeepSeek-V4 checkpoints on the CPU."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine.checkpoint import make_checkpoint
from kvtier.engine.engine import Engine
from kvtier.engine.formats import FormatError, KVFormat
from kvtier.engine.stateblocks import LocalStateBlocks
from kvtier.engine.worker import WorkerProcess
from kvtier.tools.kvbench import main as kvbench
from kvtier.transfer.fetcher import LocalFetcher

MakeEngine = Callable[..., Engine]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cluster_file(make_cluster) -> Path:
    return make_cluster(capacity_bytes=64 << 20).config_path


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("v4") / "tiny", "v4-tiny", seed=0)


@pytest.fixture
def engine() -> Iterator[MakeEngine]:
    made: list[Engine] = []

    def make(checkpoint: Path, store: Path | None, kv_format: str = "exact", **kw: Any) -> Engine:
        kw.setdefault("state_blocks", LocalStateBlocks())
        made.append(Engine.from_pretrained(checkpoint, store=store, cache_tokens=8192, kv_format=kv_format, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stored(e: Engine, tokens: list[int], index: int) -> bytes:
    """Block ``index`` of ``tokens`` as the store holds it."""
    assert e.store is not None
    keys = e.store.keys(tokens)
    buf = bytearray(e.block_bytes)
    assert e.store.get_into(
        keys[: index + 1], [memoryview(bytearray(e.block_bytes))] * index + [memoryview(buf)], tokens
    )
    return bytes(buf)


# -- the format is part of the key -------------------------------------------------------------------------


@pytest.mark.parametrize(("writer", "reader"), [("exact", "fp8-e4m3"), ("fp8-e4m3", "exact"), ("fp8-e4m3", "mxfp8")])
def test_a_block_written_in_one_format_is_a_miss_for_an_engine_of_another(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine, writer: str, reader: str
) -> None:
    p = prompt(900, seed=hash((writer, reader)) % 1000)
    engine(checkpoint, cluster_file, writer).generate([p], 2)
    other = engine(checkpoint, cluster_file, reader)
    assert other.store is not None and other.store.match(other.store.keys(p)) == 0
    [r] = other.generate([p], 8)
    assert r.hit_tokens == 0 and r.tokens == other.generate([p], 8, reuse=False)[0].tokens


def test_the_exact_format_keeps_todays_keys_and_every_other_names_itself(checkpoint: Path) -> None:
    exact = Engine.from_pretrained(checkpoint)
    assert (exact.namespace.kv_dtype, exact.state_namespace.kv_dtype) == ("float32", "float32")
    names = {Engine.from_pretrained(checkpoint, kv_format=f).namespace.kv_dtype for f in ("bf16", "fp8-e4m3", "mxfp8")}
    assert len(names) == 3 and all(n.startswith("kvformat.v1[float32][main:") for n in names)
    seed = Engine.from_pretrained(checkpoint, kv_format="seed")
    assert seed.state_namespace.kv_dtype.startswith("kvformat.v1[float32][window:mxfp8]")


def test_a_state_block_of_another_format_is_not_read(checkpoint: Path, cluster_file: Path, engine: MakeEngine) -> None:
    states = LocalStateBlocks()  # shared by both engines: only the keys keep the formats apart
    p = prompt(1000, seed=31)
    engine(checkpoint, cluster_file, "main=fp8-e4m3", state_blocks=states).generate([p[:800]], 1)
    [r] = engine(checkpoint, cluster_file, "main=fp8-e4m3,window=mxfp8", state_blocks=states).generate([p], 1)
    assert (r.hit_tokens, r.replayed) == (768, True)  # the blocks are the same format, the StateBlock is not


# -- only encoded bytes leave the engine, and they come back the same any way ----------------------------------


def test_the_store_holds_the_encoded_block_of_each_page(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine
) -> None:
    e = engine(checkpoint, cluster_file, "fp8-e4m3")
    p = prompt(700, seed=32)
    with e.start(p, 1) as g:
        while not g.finish_reason:
            g.step()
        page = e.cache.block(g.seq.pages[3])
        want = e.block_format.encode(page[None])[0].numpy().tobytes()
    assert e.block_bytes == 8192 * 17 // 16  # a page: 8,192 float32 values; 1 byte + 1/16 of a scale a value
    assert stored(e, p, 3) == want


@pytest.mark.parametrize("kv_format", ["bf16", "fp8-e4m3", "mxfp4", "seed"])
def test_reuse_in_a_format_decodes_what_was_stored_and_stays_near_the_exact_logits(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine, kv_format: str
) -> None:
    e = engine(checkpoint, cluster_file, kv_format)
    p = prompt(1000, seed=33 + len(kv_format))  # (seed's blocks are fp8-e4m3's: another prompt each)
    [cold] = e.generate([p], 4)
    [warm] = e.generate([p], 4)
    [again] = e.generate([p], 4)
    assert (warm.hit_tokens, warm.replayed) == (768, False)
    assert torch.equal(warm.first_logits, again.first_logits)  # the same bytes decode the same every time
    assert 0 < (warm.first_logits - cold.first_logits).abs().max().item() < 1.0


def test_a_block_decodes_the_same_through_the_fetcher_as_through_the_store_client(
    checkpoint: Path, cluster_file: Path, engine: MakeEngine, tmp_path: Path
) -> None:
    p = prompt(1000, seed=34)
    direct = engine(checkpoint, cluster_file, "seed")
    direct.generate([p[:900]], 1)
    [through_client] = direct.generate([p], 4)
    shm = f"kvt-formats-{secrets.token_hex(6)}"
    with LocalFetcher(cluster_file, shm, tmp_path / "fetcher.sock", "8MiB") as fetcher:
        pooled = engine(checkpoint, cluster_file, "seed", state_blocks=direct.state_blocks, fetcher=fetcher.socket_path)
        [cold] = pooled.generate([p], 4)  # read from the store into the pool, decoded by the swap-in
        pooled.generate([p[:896] + prompt(200, seed=35)], 1)  # (puts its own blocks through the pool)
        [warm] = pooled.generate([p], 4)  # a pool hit
        stats = pooled.transfer.client.stats()
    assert cold.hit_tokens == warm.hit_tokens == through_client.hit_tokens == 768
    assert torch.equal(cold.first_logits, through_client.first_logits)
    assert torch.equal(warm.first_logits, through_client.first_logits)
    assert stats["hits"] > 0


def test_state_blocks_are_kept_encoded(checkpoint: Path, cluster_file: Path, engine: MakeEngine) -> None:
    states = LocalStateBlocks()
    e = engine(checkpoint, cluster_file, "seed", state_blocks=states)
    e.generate([prompt(400, seed=36)], 1)
    exact = Engine.from_pretrained(checkpoint)
    assert len(states) == 3 and e.state_bytes < exact.state_bytes
    assert {int(b.numel()) for b in states._blocks.values()} == {e.state_bytes}  # 528 B a 512-wide row in MXFP8


# -- DeepSeek-V4: each part its own codec ---------------------------------------------------------------------


def test_deepseek_v4_blocks_and_state_blocks_take_a_codec_per_part(v4: Path) -> None:
    e = Engine.from_pretrained(v4, kv_format="seed")
    kinds = [(s.codec, s.rows, s.width) for s in e.block_format.segments]
    assert kinds[:3] == [("fp8-e4m3", 1, 64), ("fp8-e4m3", 32, 64), ("mxfp4", 32, 32)]  # HCA, CSA entries, CSA keys
    window, state = e.state_format.segments
    assert (window.codec, window.width, state.codec) == ("mxfp8", 64, "exact")
    assert e.block_bytes < e.cache.page_bytes / 3 and e.state_bytes < Engine.from_pretrained(v4).state_bytes / 3


def test_deepseek_v4_reuse_in_the_seed_format_through_the_store(
    v4: Path, cluster_file: Path, engine: MakeEngine
) -> None:
    e = engine(v4, cluster_file, "seed")
    p = prompt(1000, seed=37)
    [cold] = e.generate([p], 8)
    [warm] = e.generate([p], 8)
    assert (warm.hit_tokens, warm.replayed) == (896, False)
    assert 0 < (warm.first_logits - cold.first_logits).abs().max().item() < 1.0


def test_rope_channels_can_keep_another_codec(v4: Path) -> None:
    e = Engine.from_pretrained(v4, kv_format="main=fp8-e4m3,rope=bf16")
    assert [s.codec for s in e.block_format.segments[:5]] == ["fp8-e4m3", "bf16", "fp8-e4m3", "bf16", "exact"]
    nope, rope = e.block_format.segments[2:4]  # a CSA layer's entries (its indexer's keys stay exact, whole)
    assert (nope.codec, nope.width, rope.codec, rope.width) == ("fp8-e4m3", 48, "bf16", 16)
    assert rope.dst_offset - nope.dst_offset == 48 * 4 and nope.dst_row_stride == rope.dst_row_stride == 64 * 4


# -- refusals: one line ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("fp4", "use one of exact, bf16, fp8-e4m3, mxfp8, mxfp4, seed or KIND=CODEC"),
        ("main=nvfp4", "CODEC in exact, bf16, fp8-e4m3, mxfp8, mxfp4"),
        ("state=mxfp8", "state (accumulators, float32 gates) stays exact"),
    ],
)
def test_a_format_that_does_not_parse_is_one_line(text: str, says: str) -> None:
    with pytest.raises(FormatError, match=re.escape(says)) as e:
        KVFormat.parse(text)
    assert "\n" not in str(e.value)


def test_a_format_a_model_cannot_take_is_one_line(v4: Path) -> None:
    with pytest.raises(FormatError, match="mxfp8 needs rows of a multiple of 32 values, not 48"):
        Engine.from_pretrained(v4, kv_format="window=mxfp8,rope=bf16")  # 64 channels, 16 of them RoPE
    with pytest.raises(FormatError, match=re.escape("decode to bfloat16 or float32, not torch.float64")):
        Engine.from_pretrained(v4, dtype=torch.float64, kv_format="bf16")


def test_named_formats_parse_to_their_table_and_explicit_ones_find_their_name() -> None:
    assert KVFormat.parse("seed").codecs == (("index", "mxfp4"), ("main", "fp8-e4m3"), ("window", "mxfp8"))
    assert KVFormat.parse("main=fp8-e4m3, index=mxfp4 ,window=mxfp8").name == "seed"
    assert KVFormat.parse("main=exact").name == "exact"


# -- P/D workers: --kv-format ----------------------------------------------------------------------------------


def test_prefill_and_decode_workers_meet_in_their_format_and_not_in_another(
    checkpoint: Path, cluster_file: Path
) -> None:
    argv = [sys.executable, "-m", "kvtier.transfer.directory", "--config", str(cluster_file), "--listen", "127.0.0.1:0"]
    directory = WorkerProcess(argv).wait_ready()
    common = ["--checkpoint", str(checkpoint), "--store", str(cluster_file), "--directory", directory.ready.split()[1]]
    workers = [WorkerProcess.engine(role, *common, "--kv-format", f) for role, f in
               (("prefill", "seed"), ("decode", "seed"), ("decode", "exact"))]  # fmt: skip
    try:
        prefill, decode, other = (w.wait_ready() for w in workers)
        p = prompt(1000, seed=38)
        prefill.ask({"id": 1, "prompt": p})
        out = decode.ask({"id": 1, "prompt": p, "max_new_tokens": 8})
        missed = other.ask({"id": 1, "prompt": p, "max_new_tokens": 8})
    finally:
        for w in workers:
            w.stop()
        directory.proc.terminate()
        directory.stop()
    assert (out["hit_tokens"], out["replayed"]) == (960, False)  # its StateBlock pulled, encoded, from prefill's host
    assert missed["hit_tokens"] == 0


def test_a_worker_given_a_format_it_cannot_take_says_so_in_one_line(v4: Path, cluster_file: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvtier.engine.cli", "prefill", "--checkpoint", str(v4), "--store", str(cluster_file),
         "--kv-format", "window=mxfp8,rope=bf16"],
        input="", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("kvtier-engine: KV format window=mxfp8,rope=bf16: ")


# -- the benchmarks (what they report, not how fast) -----------------------------------------------------------


def test_kvbench_kv_format_reports_each_formats_error_agreement_and_bytes(
    cluster_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--config", str(cluster_file), "kv-format", "--prompts", "2", "--lengths", "700-900", "--new-tokens", "4"]
    assert kvbench([*args, "--format", "exact", "--format", "mxfp4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    exact, mxfp4 = result["formats"]["exact"], result["formats"]["mxfp4"]
    assert [r["prompt_tokens"] for r in exact["prompts"]] == [700, 900]
    assert all(r["hit_tokens"] > 0 for r in exact["prompts"] + mxfp4["prompts"])
    assert exact["max_abs_dlogit_max"] <= 1e-4 and exact["token_agreement"] == 1  # the reuse path's own floor
    assert mxfp4["max_abs_dlogit_median"] > 0 and mxfp4["block_bytes"] == exact["block_bytes"] // 4 * 17 // 32


def test_kvbench_kv_bytes_gives_each_tier_per_format_and_says_which_a_model_cannot_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    formats = ["--kv-format", "exact", "--kv-format", "seed", "--kv-format", "window=mxfp8,rope=bf16"]
    assert kvbench(["kv-bytes", "--models", "v4-h200,v4-tiny", *formats, "--json"]) == 0
    rows = {(r["model"], r["kv_format"]): r for r in json.loads(capsys.readouterr().out)["models"]}
    exact, seed = rows[("v4-h200", "exact")], rows[("v4-h200", "seed")]
    assert seed["hbm_bytes_per_token"] == exact["hbm_bytes_per_token"] == exact["block_bytes_per_token"]
    assert seed["block_bytes_per_token"] < exact["block_bytes_per_token"] / 2  # the pool's and the wire's
    assert (
        seed["store_bytes_per_token"] < exact["store_bytes_per_token"] / 2
        and seed["store_blocks"] > 2 * exact["store_blocks"]
    )
    assert seed["state_block_bytes"] == 16 * 134 * 528 + 107_520  # MXFP8 window rows: 528 B each at width 512
    assert "multiple of 32 values, not 48" in rows[("v4-tiny", "window=mxfp8,rope=bf16")]["error"]


def test_kvbench_swapin_with_a_format_decodes_a_models_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    bench = ["swapin", "--kv-format", "seed", "--model", "v4-tiny", "--cpu-bytes", "256KiB", "--rounds", "1"]
    assert kvbench([*bench, "--no-gpu", "--json"]) == 0
    [cpu] = json.loads(capsys.readouterr().out)["cpu_formats"].values()
    assert cpu["block_bytes"] == 5_600 and cpu["blocks"] == (256 << 10) // 5_600 and cpu["gbps"]["swap_in"] > 0


def test_kvbench_ttft_moves_blocks_in_the_engines_format(
    cluster_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = ["ttft", "--prompt-tokens", "300", "--hits", "50", "--repeats", "1", "--kv-format", "fp8-e4m3", "--json"]
    assert kvbench(["--config", str(cluster_file), *bench]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["block_bytes"] == 8192 * 17 // 16
    assert result["points"][0]["hit_bytes"] == 2 * 8192 * 17 // 16  # 128 tokens: two encoded blocks
