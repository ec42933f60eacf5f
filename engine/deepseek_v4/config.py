"""DeepSeek-V4's shape, read from a Hugging Face ``config.json`` (``model_type: deepseek_v4``) with the semantics
transformers ≥ 5.25 gives the same file (``DeepseekV4Config.__post_init__``), legacy fields included:

- ``layer_types``: per layer ``sliding_attention`` (window only), ``compressed_sparse_attention`` (CSA: window + one
  entry per ``compress_rates[CSA]`` tokens, top-k chosen by the lightning indexer) or
  ``heavily_compressed_attention`` (HCA: window + one entry per ``compress_rates[HCA]`` tokens, all visible). Legacy
  ``compress_ratios`` (0 / 4 / 128 per layer) fold in; absent, 2 HCA layers then CSA / HCA alternating.
- ``mlp_layer_types``: ``hash_moe`` (experts chosen by ``tid2eid[token]``) or ``moe`` (top-k routing); legacy
  ``num_hash_layers``; absent, 3 hash layers then top-k.
- RoPE: two sets, ``main`` (sliding-only layers) and ``compress`` (CSA / HCA layers, their compressors and the
  indexer), each ``default`` or ``yarn`` over the trailing ``int(head_dim * partial_rotary_factor)`` channels
  (interleaved pairs). A flat ``rope_parameters`` becomes ``main`` = default at ``rope_theta`` and ``compress`` = the
  flat one at ``compress_rope_theta`` (yarn with ``attention_factor`` 1.0 unless given).

Fields transformers ignores are ignored here too (``num_key_value_heads``: the one K = V head is built in;
``n_shared_experts``: one shared expert; ``norm_topk_prob``: routed weights are always normalised).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.engine.config import UnsupportedModelError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class RopeSet:
    """One RoPE set: inverse frequencies over the trailing ``dim`` channels of a head, cos/sin scaled by
    ``attention_scaling``."""

    dim: int
    inv_freq: tuple[float, ...]
    attention_scaling: float

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.inv_freq, dtype=torch.float32)


@dataclass(frozen=True)
class V4Config:
    family: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    mlp_bias: bool
    rope_main: RopeSet
    rope_compress: RopeSet
    torch_dtype: str = "float32"

    @property
    def csa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == CSA]

    @property
    def hca_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == HCA]

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer`` (0 for a sliding-only layer)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> V4Config:
        try:
            return _parse(raw, where)
        except KeyError as missing:
            raise UnsupportedModelError(f"{where}: required field {missing} is missing") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, UnsupportedModelError):
                raise
            raise UnsupportedModelError(f"{where}: {e}") from None


def _parse(raw: dict[str, Any], where: str) -> V4Config:
    def bad(msg: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{where}: {msg}")

    if raw.get("hidden_act", "silu") != "silu":
        raise bad(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("quantization_config"):
        raise bad("quantized weights (quantization_config) are not supported; give a bf16 or fp32 checkpoint")
    n = int(raw.get("num_hidden_layers", 43))
    head_dim = int(raw.get("head_dim", 512))
    rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = raw["compress_rate_hca"]
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        try:
            types = [_RATIO_TO_TYPE[int(r)] for r in raw["compress_ratios"]]
        except KeyError as r:
            raise bad(f"compress_ratios entries must be 0, 4 or 128, got {r}") from None
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    mlp = raw.get("mlp_layer_types")
    if mlp is None:
        hashed = raw.get("num_hash_layers")
        hashed = 3 if hashed is None else int(hashed)
        mlp = [HASH_MOE] * min(n, hashed) + [MOE] * max(0, n - hashed)
    mlp = list(mlp)[:n]
    for name, got, allowed in (("layer_types", types, LAYER_TYPES), ("mlp_layer_types", mlp, (HASH_MOE, MOE))):
        if len(got) != n or any(t not in allowed for t in got):
            raise bad(f"{name} must list {n} entries of {', '.join(allowed)}; got {got!r}")
    csa_rate, hca_rate = int(rates.get(CSA, 4)), int(rates.get(HCA, 128))
    if csa_rate < 1 or hca_rate < 1:
        raise bad(f"compress_rates must be positive, got {rates!r}")
    partial = raw.get("partial_rotary_factor")
    if partial is None:
        legacy = raw.get("qk_rope_head_dim")
        partial = legacy / head_dim if legacy is not None else 64 / 512
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING:
        raise bad(f"scoring_func {scoring!r} is not supported ({', '.join(SCORING)})")
    heads, groups = int(raw.get("num_attention_heads", 64)), int(raw.get("o_groups", 8))
    if heads % groups:
        raise bad(f"num_attention_heads ({heads}) must be a multiple of o_groups ({groups})")
    main, compress = _rope_sets(raw, float(partial))
    max_pos = int(raw.get("max_position_embeddings", 1048576))
    return V4Config(
        family="deepseek_v4",
        vocab_size=int(raw.get("vocab_size", 129280)),
        hidden_size=int(raw.get("hidden_size", 4096)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 2048)),
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        q_lora_rank=int(raw.get("q_lora_rank", 1024)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 6)),
        n_routed_experts=int(raw.get("n_routed_experts", 256)),
        scoring_func=scoring,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        max_position_embeddings=max_pos,
        layer_types=tuple(types),
        mlp_layer_types=tuple(mlp),
        csa_rate=csa_rate,
        hca_rate=hca_rate,
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        sliding_window=int(raw.get("sliding_window", 128)),
        o_groups=groups,
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_main=_rope_set(main, head_dim, max_pos, "main", where),
        rope_compress=_rope_set(compress, head_dim, max_pos, "compress", where),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
    )


def _rope_sets(raw: dict[str, Any], partial: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``main`` and ``compress`` parameter dicts, nested as written or built from a flat one."""
    rp = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = raw.get("rope_theta", 10000.0)
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
        for sub in (main, compress):  # what transformers' standardisation fills in
            sub.setdefault("rope_theta", theta)
            sub.setdefault("partial_rotary_factor", partial)
        return main, compress
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
    compress = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0), "partial_rotary_factor": partial}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _rope_set(params: dict[str, Any], head_dim: int, max_pos: int, label: str, where: str) -> RopeSet:
    """Inverse frequencies as transformers computes them (``compute_default_rope_parameters`` /
    ``_compute_yarn_parameters``, whose ``truncate`` V4 never sets: always true)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{where}: rope type {kind!r} of {label!r} is not supported ({', '.join(ROPE_TYPES)})"
        )
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if kind == "default":
        return RopeSet(dim, tuple((1.0 / pos_freqs).tolist()), 1.0)
    original = params.get("original_max_position_embeddings", max_pos)
    factor = params.get("factor")
    factor = max_pos / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return RopeSet(dim, tuple(inv.tolist()), float(attention))


def _mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
