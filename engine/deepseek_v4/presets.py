"""Seeded random DeepSeek-V4 checkpoints (``make-checkpoint --preset v4-tiny | v4-h200``): the config transformers
writes for such a model, and weights at a scale that keeps activations near unit size.

- ``v4-tiny``: CPU tests. V4's geometry (window 128, compress rates 4 / 128, hyper-connections, hash and top-k MoE,
  yarn on the compressed branches) at toy widths; its indexer keeps 16 entries, so prompts past 64 tokens make it
  choose.
- ``v4-h200``: one H200 (or H100): V4-Flash's attention as it is (64 heads of 512, q rank 1024, 8 output groups of
  rank 1024, indexer 64 heads of 128 keeping 512, window 128, rates 4 / 128, yarn 16× over 65,536), 16 layers in
  transformers' default mix (2 HCA, then CSA / HCA alternating; 3 hash-MoE layers), 16 experts of 2,048 (2 routed +
  1 shared per token): ~8.7 B parameters, 17 GB in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class V4Preset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    dtype: str
    layer_types: tuple[str, ...] | None = None  # None: transformers' default mix
    num_hash_layers: int = 3
    yarn_original: int = 65536
    yarn_factor: float = 16.0


V4_PRESETS = {
    "v4-tiny": V4Preset(
        512,
        64,
        5,
        4,
        64,
        32,
        2,
        32,
        64,
        8,
        2,
        4,
        32,
        16,
        4,
        "float32",
        layer_types=(
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ),
        num_hash_layers=2,
        yarn_original=4096,
        yarn_factor=8.0,
    ),
    "v4-h200": V4Preset(129280, 4096, 16, 64, 512, 1024, 8, 1024, 2048, 16, 2, 64, 128, 512, 4, "bfloat16"),
}


def v4_config_dict(p: V4Preset, sliding_window: int = 128) -> dict[str, Any]:
    """The ``config.json`` of preset ``p`` as transformers ≥ 5.25 writes one (nested ``main`` / ``compress`` RoPE)."""
    partial = 0.125 if p.head_dim >= 512 else 0.25
    raw: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "moe_intermediate_size": p.moe_intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": 1,
        "head_dim": p.head_dim,
        "q_lora_rank": p.q_lora_rank,
        "num_experts_per_tok": p.num_experts_per_tok,
        "n_routed_experts": p.n_routed_experts,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": int(p.yarn_original * p.yarn_factor),
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "hc_mult": p.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "swiglu_limit": 10.0,
        "sliding_window": sliding_window,
        "o_groups": p.o_groups,
        "o_lora_rank": p.o_lora_rank,
        "index_n_heads": p.index_n_heads,
        "index_head_dim": p.index_head_dim,
        "index_topk": p.index_topk,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "partial_rotary_factor": partial,
        "qk_rope_head_dim": int(p.head_dim * partial),
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "partial_rotary_factor": partial,
                "factor": p.yarn_factor,
                "original_max_position_embeddings": p.yarn_original,
                "beta_fast": 32,
                "beta_slow": 1,
                "attention_factor": 1.0,
            },
        },
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": p.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    n = p.num_layers
    if p.layer_types is not None:
        raw["layer_types"] = list(p.layer_types)
    else:
        mix = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(n - 2)]
        raw["layer_types"] = ["heavily_compressed_attention"] * min(n, 2) + mix
    raw["mlp_layer_types"] = ["hash_moe"] * min(n, p.num_hash_layers) + ["moe"] * max(0, n - p.num_hash_layers)
    return raw


def v4_init(name: str, shape: tuple[int, ...], gen: torch.Generator, experts: int) -> torch.Tensor:
    """A random tensor for the checkpoint tensor ``name`` (DeepSeek's names, as saved)."""
    if name.endswith("tid2eid"):
        return torch.randint(0, experts, shape, generator=gen, device=gen.device)
    r = torch.randn(shape, generator=gen, device=gen.device)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight") or leaf.endswith("_scale") or leaf == "hc_scale":
        return 1 + 0.1 * r
    if leaf in ("attn_sink", "ape", "bias") or leaf.endswith("_base"):
        return 0.1 * r
    if "embed" in name:
        return r
    if leaf.endswith("_fn") or leaf == "hc_fn":
        return 0.1 * r / shape[1] ** 0.5
    scale = 4.0 if name == "head.weight" else 1.0
    return scale * r / shape[-1] ** 0.5
