"""Hugging Face–format checkpoints: load one (``config.json`` + ``*.safetensors``), write a seeded random one,
and name one by a digest of its bytes.

``make_checkpoint`` writes what ``save_pretrained`` would: a transformers 5.x ``config.json``
(``rope_parameters``) and weights in safetensors shards of at most ``shard_bytes`` with an index, so
transformers and this engine load the same directory; and a trained tokenizer with its chat template and
end-of-sequence tokens (``tokenizer_files``), so a server can take text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from kvtier.engine.config import FULL, SLIDING, ModelConfig, Shape, UnsupportedModelError
from kvtier.engine.model import CausalLM
from kvtier.engine.tokenizer_files import write_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Preset(Shape):
    dtype: str


PRESETS = {
    "tiny": Preset(512, 64, 128, 4, 4, 2, 16, "float32"),  # CPU tests: a 4,000-token forward in well under 1 s
    "small": Preset(2048, 256, 768, 6, 8, 2, 32, "float32"),  # CPU benchmarks
    "1b": Preset(32000, 2048, 8192, 16, 32, 8, 64, "bfloat16"),
    "8b": Preset(128256, 4096, 14336, 32, 32, 8, 128, "bfloat16"),
}


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    """The model of the checkpoint directory ``path``, on ``device`` in ``dtype``, in eval mode.

    Raises UnsupportedModelError (one line) for a config of another family, missing weights or weights of
    the wrong shape.
    """
    path = Path(path)
    config = ModelConfig.from_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no *.safetensors files")
    with torch.device("meta"):
        model = CausalLM(config)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    where = str(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"  # straight onto a GPU
    for file in files:
        with safe_open(str(file), framework="pt", device=where) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in expected:
                    state[name] = f.get_tensor(name).to(dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    wanted = {n for n in expected if not (config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(wanted - state.keys())
    if missing:
        raise UnsupportedModelError(f"{path}: {len(missing)} weights missing, e.g. {missing[0]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UnsupportedModelError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope.inv_freq = config.inv_freq()
    return model.to(device).eval()


def model_id(path: str | Path) -> str:
    """xxh3-128 over ``config.json`` and every safetensors file (sorted by name): different weights or
    shapes never share a namespace."""
    path = Path(path)
    digest = xxhash.xxh3_128()
    for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def parse_layer_types(spec: str, num_layers: int) -> list[str]:
    """``"sliding,full"`` (repeated to ``num_layers``) → transformers' layer type names."""
    names = {"full": FULL, "sliding": SLIDING, FULL: FULL, SLIDING: SLIDING}
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in parts if p not in names]
    if not parts or unknown:
        raise ValueError(f"--layer-types takes a comma list of 'full' and 'sliding', got {spec!r}")
    return [names[parts[i % len(parts)]] for i in range(num_layers)]


def config_dict(preset: Preset, family: str, layer_types: list[str], sliding_window: int) -> dict[str, Any]:
    """A transformers 5.x config for ``preset``; qwen2 honours per-layer types, mistral slides everywhere,
    llama nowhere."""
    sliding = SLIDING in layer_types
    if family == "llama" and sliding:
        raise ValueError("a llama checkpoint has no sliding layers (use --family qwen2 for per-layer types)")
    if family == "mistral" and set(layer_types) != {SLIDING}:
        raise ValueError("a mistral checkpoint slides in every layer (use --family qwen2 for per-layer types)")
    raw: dict[str, Any] = {
        "architectures": [
            {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}[family]
        ],
        "model_type": family,
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 131072 if preset.vocab_size > 100_000 else 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "tie_word_embeddings": False,
        "torch_dtype": preset.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "qwen2":
        raw.update(use_sliding_window=sliding, sliding_window=sliding_window if sliding else None)
        raw.update(max_window_layers=0, layer_types=layer_types)
    if family == "mistral":
        raw["sliding_window"] = sliding_window
    return raw


def make_checkpoint(
    out: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    layer_types: str = "sliding,full",
    sliding_window: int = 128,
    family: str = "qwen2",
    tie_word_embeddings: bool = False,
    shard_bytes: int = 2 << 30,
    device: str = "cpu",
) -> Path:
    """Write a seeded random checkpoint of ``preset`` into ``out`` (created; must be empty or absent).

    The weights are drawn on ``device``: a seed gives the same checkpoint on the same kind of device (a GPU's
    generator is not the CPU's), and drawing 8 B weights on a GPU takes a moment where the CPU takes minutes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    types = parse_layer_types(layer_types, p.num_layers)
    raw = config_dict(p, family, types, sliding_window)
    raw["tie_word_embeddings"] = tie_word_embeddings
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new directory")
    config = ModelConfig.from_dict(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = torch.Generator(device).manual_seed(seed)
    itemsize = torch.empty(0, dtype=DTYPES[p.dtype]).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in _weight_shapes(config):
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    weight_map = {}
    for file, shard in zip(names, shards, strict=True):  # one shard in memory at a time
        tensors = {name: _init(name, shape, gen).to(DTYPES[p.dtype]).cpu() for name, shape in shard}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    write_tokenizer(out, p.vocab_size)
    return out


def _weight_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        model = CausalLM(config)
    for name, tensor in model.state_dict().items():
        if not (config.tie_word_embeddings and name == "lm_head.weight"):
            yield name, tuple(tensor.shape)


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random weights that keep activations near unit scale and make logits peaked (greedy decoding then
    rarely meets near-ties); norms near 1 and non-zero biases so that loading each of them matters."""
    r = torch.randn(shape, generator=gen, device=gen.device)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * r
    if name.endswith(".bias"):
        return 0.1 * r
    if "embed_tokens" in name:
        return r
    scale = 4.0 if name == "lm_head.weight" else 1.0
    return scale * r / shape[1] ** 0.5
