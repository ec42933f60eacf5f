"""The model's shape, read from a Hugging Face ``config.json`` of the Llama / Qwen2 / Mistral family.

Per-layer attention follows what transformers does with the same file, so logits match it:

- ``qwen2``: ``layer_types`` as written (``full_attention`` / ``sliding_attention``); without it, layers from
  ``max_window_layers`` on slide. The window is ``sliding_window``, and only when ``use_sliding_window`` is true
  (otherwise every layer is global, as in transformers).
- ``mistral``: every layer slides when ``sliding_window`` is set (transformers ignores ``layer_types`` there).
- ``llama``: every layer is global.

RoPE: ``rope_theta`` at the top level (transformers 4.x) or inside ``rope_parameters`` (5.x); rope types
``default`` and ``llama3``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2")
FULL, SLIDING = "full_attention", "sliding_attention"
ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is not one this engine can run (its message is one line saying why)."""


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes (what a checkpoint preset chooses and a config.json states)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelConfig(Shape):
    family: str
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    torch_dtype: str = "float32"

    @property
    def global_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING]

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies (float32), as transformers computes them for this rope type."""
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        if self.rope_scaling.get("rope_type") != "llama3":
            return inv
        s = self.rope_scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        family = raw.get("model_type")
        if family not in FAMILIES:
            raise UnsupportedModelError(
                f"{where}: model_type {family!r} is not supported; this engine runs {', '.join(FAMILIES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        try:
            hidden, heads, layers = (
                int(raw["hidden_size"]),
                int(raw["num_attention_heads"]),
                int(raw["num_hidden_layers"]),
            )
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise UnsupportedModelError(
                    f"{where}: rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})"
                )
            rope["rope_type"] = rope_type
            theta = float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))
            layer_types, window = _attention_layout(family, raw, layers, where)
            return cls(
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=family == "llama" and bool(raw.get("attention_bias", False)),
                mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
                layer_types=layer_types,
                sliding_window=window,
                rope_scaling=rope,
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except KeyError as missing:
            raise UnsupportedModelError(f"{where}: required field {missing} is missing") from None


def _attention_layout(family: str, raw: dict[str, Any], layers: int, where: str) -> tuple[tuple[str, ...], int | None]:
    """Per-layer attention types and the window, with the semantics transformers gives the same config."""
    window = raw.get("sliding_window")
    if family == "llama":
        return (FULL,) * layers, None
    if family == "mistral":
        return ((SLIDING,) * layers, int(window)) if window else ((FULL,) * layers, None)
    if not raw.get("use_sliding_window", False):
        window = None
    types = raw.get("layer_types")
    if types is None:
        start = int(raw.get("max_window_layers", 28))
        types = [SLIDING if window is not None and i >= start else FULL for i in range(layers)]
    if len(types) != layers or any(t not in (FULL, SLIDING) for t in types):
        raise UnsupportedModelError(
            f"{where}: layer_types must list {layers} entries of {FULL!r} or {SLIDING!r}, got {types!r}"
        )
    if window is None:  # transformers attends globally in every layer when no window is in force
        return (FULL,) * layers, None
    return tuple(types), int(window)
