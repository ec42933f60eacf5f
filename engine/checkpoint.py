"""Hugging Face–format checkpoints: load one (``config.json`` + ``*.safetensors``), write a seeded random one,
and name one by a digest of its bytes.

``make_checkpoint`` writes what ``save_pretrained`` would: a transformers 5.x ``config.json``
(``rope_parameters``) and weights in safetensors shards of at most ``shard_bytes`` with an index, so
transformers and this engine load the same directory; and a trained tokenizer with its chat template and
end-of-sequence tokens (``tokenizer_files``), so a server can take text.
"""

from __future__ import annotations

import contextlib
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
from torch import nn

from kvtier.engine.config import FULL, SLIDING, Shape, UnsupportedModelError
from kvtier.engine.deepseek_v4.presets import V4_PRESETS, v4_config_dict, v4_init
from kvtier.engine.family import Family, family_of
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


def read_config(path: str | Path) -> tuple[Family, Any]:
    """The family and config of the checkpoint directory ``path`` (UnsupportedModelError, one line, for a
    directory without a valid ``config.json`` or of a family this engine does not run)."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise UnsupportedModelError(f"{path}: no config.json (expected a Hugging Face model directory)") from None
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{file}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{file}: expected a JSON object")
    family = family_of(raw, str(file))
    return family, family.parse(raw, str(file))


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of the checkpoint directory ``path``, on ``device`` in ``dtype``, in eval mode.

    Raises UnsupportedModelError (one line) for a config of another family, missing weights or weights of
    the wrong shape. Parameters the model keeps in another dtype (DeepSeek-V4's hyper-connections, norms, sinks
    and position biases in float32, its hash table as integers) keep theirs.
    """
    path = Path(path)
    family, config = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no *.safetensors files")
    with torch.device("meta"):
        model = family.build(config)
    expected = model.state_dict()
    where = str(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"  # straight onto a GPU
    with contextlib.ExitStack() as stack:  # every shard open at once: a tensor may need others' (stacked experts)
        opened = [stack.enter_context(safe_open(str(file), framework="pt", device=where)) for file in files]
        owner = {name: f for f in opened for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        state = family.load_weights(config, list(owner), lambda name: owner[name].get_tensor(name), str(path))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    wanted = {n for n in expected if not (config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(wanted - state.keys())
    if missing:
        raise UnsupportedModelError(f"{path}: {len(missing)} weights missing, e.g. {missing[0]}")
    for name in list(state):
        if name not in wanted:
            del state[name]
            continue
        tensor, want = state[name], expected[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise UnsupportedModelError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, the config implies {tuple(want.shape)}"
            )
        keep = not want.is_floating_point() or any(part in name for part in family.keep_float32)
        state[name] = tensor.to(want.dtype if keep else dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_buffers()
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

    A dense preset (``PRESETS``) takes ``family`` and ``layer_types``; a DeepSeek-V4 preset (``V4_PRESETS``) has its
    own layer mix and writes the names transformers saves V4 under. The weights are drawn on ``device``: a seed gives
    the same checkpoint on the same kind of device (a GPU's generator is not the CPU's), and drawing 8 B weights on a
    GPU takes a moment where the CPU takes minutes."""
    if preset in V4_PRESETS:
        v4 = V4_PRESETS[preset]
        raw, dtype, vocab = v4_config_dict(v4, sliding_window), v4.dtype, v4.vocab_size

        def init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
            return v4_init(name, shape, gen, v4.n_routed_experts)

    elif preset in PRESETS:
        p = PRESETS[preset]
        raw = config_dict(p, family, parse_layer_types(layer_types, p.num_layers), sliding_window)
        dtype, vocab, init = p.dtype, p.vocab_size, _init
    else:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join([*PRESETS, *V4_PRESETS])}")
    raw["tie_word_embeddings"] = tie_word_embeddings
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new directory")
    kind = family_of(raw, preset)
    config = kind.parse(raw, preset)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = torch.Generator(device).manual_seed(seed)
    itemsize = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in _weight_shapes(kind, config):
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
        tensors = {}
        for name, shape in shard:
            t = init(name, shape, gen)
            tensors[name] = (t.to(DTYPES[dtype]) if t.is_floating_point() else t).cpu()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    write_tokenizer(out, vocab)
    return out


def _weight_shapes(family: Family, config: Any) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor a checkpoint of ``config`` holds, under the names it is saved with."""
    with torch.device("meta"):
        model = family.build(config)
    state = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    for name, tensor in family.saved_weights(config, state).items():
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
