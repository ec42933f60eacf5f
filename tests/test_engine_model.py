"""The engine's model gives transformers' logits on the same checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvtier.engine import cli
from kvtier.engine.checkpoint import load, make_checkpoint, model_id
from kvtier.engine.config import UnsupportedModelError
from kvtier.engine.dense import forward_logits

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt(n: int, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def reference_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf(tokens[None]).logits[0]


@pytest.mark.parametrize(
    ("family", "layer_types", "tied", "length"),
    [
        ("qwen2", "sliding,full", False, 3000),  # hybrid: per-layer windows
        ("mistral", "sliding", False, 1500),  # every layer slides
        ("llama", "full", True, 1000),  # no window, tied embeddings
    ],
)
def test_logits_equal_transformers(tmp_path: Path, family: str, layer_types: str, tied: bool, length: int) -> None:
    path = make_checkpoint(
        tmp_path / family, "tiny", seed=0, layer_types=layer_types, family=family, tie_word_embeddings=tied
    )
    tokens = prompt(length)
    ours = forward_logits(load(path), tokens, chunk_tokens=512)
    assert (ours - reference_logits(path, tokens)).abs().max().item() <= TOLERANCE


def test_transformers_4_config_loads_like_5(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "v5", "tiny", seed=0)
    v5 = forward_logits(load(path), prompt(300))
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (path / "config.json").write_text(json.dumps(config))
    assert torch.equal(forward_logits(load(path), prompt(300)), v5)


def test_seeded_checkpoints_are_reproducible_and_named_by_content(tmp_path: Path) -> None:
    a, b, c = (make_checkpoint(tmp_path / n, "tiny", seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    assert model_id(a) == model_id(b) != model_id(c)


def test_unsupported_family_is_one_clear_line(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "ck", "tiny", seed=0)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported") as info:
        load(path)
    assert "\n" not in str(info.value)


def test_make_checkpoint_cli_writes_a_loadable_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert cli.main(["make-checkpoint", "--preset", "tiny", "--seed", "0", str(out)]) == 0
    assert model_id(out) == model_id(make_checkpoint(tmp_path / "api", "tiny", seed=0))
    capsys.readouterr()
    assert cli.main(["make-checkpoint", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty" in err


def test_a_sharded_checkpoint_loads_like_one_file(tmp_path: Path) -> None:
    whole = make_checkpoint(tmp_path / "whole", "tiny", seed=0)
    sharded = make_checkpoint(tmp_path / "sharded", "tiny", seed=0, shard_bytes=100_000)
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").exists()
    tokens = prompt(200)
    assert torch.equal(forward_logits(load(sharded), tokens), forward_logits(load(whole), tokens))
    assert (forward_logits(load(sharded), tokens) - reference_logits(sharded, tokens)).abs().max().item() <= TOLERANCE
