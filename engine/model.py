"""A decoder of the Llama / Qwen2 / Mistral family, one sequence at a time, in plain torch.

    h = embed(tokens)
    for each layer:  h = h + o(attn(rope(q(n1(h))), rope(k(n1(h))), v(n1(h))))      n1, n2: RMSNorm
                     h = h + down(silu(gate(n2(h))) * up(n2(h)))
    logits = lm_head(norm(h))

Where keys and values live is not the model's business: each attention layer hands its new (q, k, v) to a
:class:`KVContext`, which keeps them (paged for global layers, a window for sliding ones) and returns the
attention output. Parameter names equal the Hugging Face ones, so a checkpoint's state dict loads as is.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from kvtier.engine.config import SLIDING, ModelConfig


class KVContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Keep ``k``/``v`` ([T, kv_heads, head_dim], RoPE applied) of layer ``layer`` for this chunk's
        positions and return attention of ``q`` ([T, heads, head_dim]) over what the layer may see."""
        ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Causal (and, with ``window``, sliding: key ``j`` visible to query ``i`` iff ``i - window < j <= i``)
    grouped-query attention. q: [T, H, D]; k, v: [S, KVH, D]; positions absolute. Returns [T, H, D]."""
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
        if q.is_cuda:  # a masked GQA call falls back to the math kernel there; with the heads repeated it does not
            groups = q.shape[1] // k.shape[1]
            k4, v4 = (x.repeat_interleave(groups, dim=1) for x in (k4, v4))
            return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=visible)[0].transpose(0, 1)
    # 4-D inputs: on the CPU that takes torch's fused (flash) kernel, 3-D ones the much slower math path
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=visible, enable_gqa=True)
    return out[0].transpose(0, 1)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention of one query in each of a batch of sequences, their keys padded to one length:
    q [B, H, D]; k, v [B, KVH, S, D]; ``visible`` [B, S] (False: padding). Returns [B, H, D]."""
    q4, mask = q[:, :, None], visible[:, None, None, :]
    if q.is_cuda:  # as in :func:`attention`: masked GQA with the heads repeated keeps the efficient kernel
        groups = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask)[:, :, 0]
    return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`attention` without a window for queries that are the last ``T`` of the ``S`` keys' positions
    (``0 … S-1``): on a GPU the flash kernel with its causal mask aligned to the bottom right, no mask in
    memory (a ``T × S`` one is 6 GB at 77K tokens in one chunk); on the CPU the same mask as :func:`attention`."""
    if not q.is_cuda:
        t, s = q.shape[0], k.shape[0]
        return attention(q, k, v, torch.arange(s - t, s), torch.arange(s), None)
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _flash_takes_grouped_heads(q.dtype):  # else the fallback would be a T × S mask
        k4, v4 = (x.repeat_interleave(groups, dim=1) for x in (k4, v4))
    bias = causal_lower_right(q.shape[0], k.shape[0])
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, enable_gqa=groups > 1)[0].transpose(0, 1)


@functools.cache
def _flash_takes_grouped_heads(dtype: torch.dtype) -> bool:
    """Whether this torch's flash kernel takes fewer key/value heads than query heads on this GPU."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    q = torch.empty(1, 4, 128, 128, device="cuda", dtype=dtype)
    kv = torch.empty(1, 2, 256, 128, device="cuda", dtype=dtype)
    return can_use_flash_attention(SDPAParams(q, kv, kv, None, 0.0, False, True))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in float32, cast back, then weighted."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


class Rope(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", config.inv_freq(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]: broadcast over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, ctx: KVContext
    ) -> torch.Tensor:
        t = x.shape[0]
        q = rotate(self.q_proj(x).view(t, self.heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        return self.o_proj(ctx.attend(layer, q, k, v).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, ctx: KVContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model. ``forward`` runs one chunk of one sequence; ``ctx`` holds everything before it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.rope = Rope(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self) -> None:
        """Compute the buffers a checkpoint does not hold (RoPE's frequencies), e.g. after building on ``meta``."""
        self.rope.inv_freq = self.config.inv_freq()

    def windows(self) -> list[int | None]:
        """Per layer: the sliding window, or None for a global layer."""
        c = self.config
        return [c.sliding_window if t == SLIDING else None for t in c.layer_types]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: KVContext) -> torch.Tensor:
        """Final hidden states [T, hidden] of ``tokens`` at absolute ``positions`` (both [T])."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, ctx)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
