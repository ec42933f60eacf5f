"""DeepSeek-V4 parameter names: what a checkpoint on disk says ↔ this engine's modules.

transformers saves V4 under DeepSeek's own names inside each layer (``attn.wq_a``, ``ffn.experts.3.w1``,
``hc_attn_fn``, ``head.weight`` …) and renames them when it loads (its ``conversion_mapping``); a state dict taken
from the loaded model has its module names (``self_attn.q_a_proj``, ``mlp.experts.gate_up_proj``,
``self_attn.compressor.indexer.scorer.weights_proj`` …). Both load here, and DeepSeek's release without the
``model.`` prefix (``embed.weight``, ``layers.0.…``, ``hc_head_fn``). Per-expert weights are stacked into the 3-D
``gate_up_proj`` (w1 rows, then w3 rows) and ``down_proj`` (w2) as transformers does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from kvtier.engine.config import UnsupportedModelError

_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# Inside a layer, DeepSeek's name → this engine's, whole dotted segments (each rule in turn, as transformers does).
_LAYER = [
    (r"^attn\.indexer\.compressor\.", "self_attn.indexer.compressor."),
    (r"^attn\.indexer\.wq_b\.", "self_attn.indexer.q_b_proj."),
    (r"^attn\.", "self_attn."),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.", "mlp."),
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_attn_(fn|base|scale)$", r"attn_hc.\1"),
    (r"^hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
    # transformers' module names that differ from this engine's
    (r"^self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "self_attn.indexer.weights_proj."),
    (r"^self_attn\.compressor\.indexer\.q_b_proj\.", "self_attn.indexer.q_b_proj."),
    (r"^self_attn\.compressor\.indexer\.", "self_attn.indexer.compressor."),
]
_LEAF = {
    "wq_a": "q_a_proj",
    "q_norm": "q_a_norm",
    "wq_b": "q_b_proj",
    "wkv": "kv_proj",
    "wgate": "gate_proj",
    "norm": "kv_norm",
    "wo_a": "o_a_proj",
    "wo_b": "o_b_proj",
    "attn_sink": "sinks",
    "ape": "position_bias",
}
_SHARED = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")
_LAYER_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def canonical(name: str) -> str:
    """This engine's name for the checkpoint tensor ``name`` (per-expert weights keep their expert index)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_KEY.match(name)
    if not m:
        return name
    layer, rest = m.groups()
    for pattern, repl in _LAYER:
        rest = re.sub(pattern, repl, rest)
    parts = rest.split(".")
    if parts[0] == "self_attn":
        parts = [_LEAF.get(p, p) if i else p for i, p in enumerate(parts)]
    if parts[:2] == ["mlp", "shared_experts"] and len(parts) > 2:
        parts[2] = _SHARED.get(parts[2], parts[2])
    return f"model.layers.{layer}." + ".".join(parts)


def load_tensors(
    names: Iterable[str], get: Callable[[str], torch.Tensor], num_experts: int, where: str
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (``get(name)`` reads one), under this engine's names, per-expert weights
    stacked. Raises UnsupportedModelError for FP8 scales (a quantized checkpoint) or a missing expert."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in names:
        if name.endswith("scale_inv") or (name.endswith(".scale") and not name.endswith("_hc.scale")):
            raise UnsupportedModelError(f"{where}: {name} is a quantization scale; give a bf16 or fp32 checkpoint")
        key = canonical(name)
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = get(name)
        else:
            out[key] = get(name)
    for prefix, by_kind in experts.items():
        stacked = {}
        for kind in ("w1", "w2", "w3"):
            got = by_kind.get(kind, {})
            if sorted(got) != list(range(num_experts)):
                raise UnsupportedModelError(f"{where}: {prefix}: expected {kind} of experts 0…{num_experts - 1}")
            stacked[kind] = torch.stack([got[e] for e in range(num_experts)])
        out[f"{prefix}.gate_up_proj"] = torch.cat((stacked["w1"], stacked["w3"]), dim=1)
        out[f"{prefix}.down_proj"] = stacked["w2"]
    return out


def checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This engine's state dict under the names transformers' ``save_pretrained`` writes (per-expert weights
    split), so a checkpoint written from it loads in transformers and here alike."""
    inverse_leaf = {v: k for k, v in _LEAF.items()}
    inverse_shared = {v: k for k, v in _SHARED.items()}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key == "lm_head.weight":
            out["head.weight"] = tensor
            continue
        m = _LAYER_KEY.match(key)
        if not m:
            out[key] = tensor
            continue
        layer, rest = m.groups()
        parts = rest.split(".")
        if parts[0] == "self_attn":
            parts = ["attn", *[inverse_leaf.get(p, p) for p in parts[1:]]]
        elif parts[:2] == ["mlp", "experts"]:
            prefix = f"model.layers.{layer}.ffn.experts"
            if parts[2] == "gate_up_proj":
                w1, w3 = tensor.chunk(2, dim=1)
                for e in range(tensor.shape[0]):
                    out[f"{prefix}.{e}.w1.weight"], out[f"{prefix}.{e}.w3.weight"] = w1[e], w3[e]
            else:
                for e in range(tensor.shape[0]):
                    out[f"{prefix}.{e}.w2.weight"] = tensor[e]
            continue
        elif parts[0] == "mlp":
            if parts[1] == "shared_experts":
                parts[2] = inverse_shared.get(parts[2], parts[2])
            if parts[1:] == ["gate", "e_score_correction_bias"]:
                parts = ["mlp", "gate", "bias"]
            parts[0] = "ffn"
        elif parts[0] in ("input_layernorm", "post_attention_layernorm"):
            parts[0] = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}[parts[0]]
        elif parts[0] in ("attn_hc", "ffn_hc"):
            parts = [f"hc_{parts[0].removesuffix('_hc')}_{parts[1]}"]
        out[f"model.layers.{layer}." + ".".join(parts)] = tensor
    return out
