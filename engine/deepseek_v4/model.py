"""DeepSeek-V4 (paper §2) in plain torch, one sequence at a time, with transformers' semantics and parameter names.

    streams = embed(tokens) repeated hc_mult times                                  [T, hc, hidden]
    for each layer (§2.2, mHC):  x = collapse(streams)                              pre weights, Sinkhorn comb
                                  streams = post * attention(norm(x)) + combᵀ · streams
                                  x = collapse(streams); streams = post * moe(norm(x)) + combᵀ · streams
    logits = lm_head(norm(hc_head(streams)))

Attention (§2.3): one K = V head of ``head_dim`` (MQA), partial interleaved RoPE on the trailing channels, a
learned sink per head, a grouped low-rank output projection. Every layer attends to a sliding window of
``sliding_window`` positions; a CSA layer also to the ``index_topk`` compressed entries its lightning indexer picks
(one entry per ``csa_rate`` tokens, pooled over an overlapping window of ``2 × csa_rate``), an HCA layer to every
compressed entry (one per ``hca_rate`` tokens). Where the state that crosses a chunk boundary lives (window rows,
compressors' partial windows, compressed entries) is the business of a :class:`V4KV`, not of the model: it is
what the engine keeps in pages (entries) and StateBlocks (the rest).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.deepseek_v4.config import CSA, HASH_MOE, HCA, SLIDING, RopeSet, V4Config
from kvtier.engine.model import RMSNorm as LlamaRMSNorm

COMPRESSOR, INDEXER = "compressor", "indexer"


class V4KV(Protocol):
    """Where one sequence's attention state lives while a chunk of positions ``positions`` runs.

    Names are ``(layer, COMPRESSOR | INDEXER)`` pairs, one per compressor (a CSA layer has both, an HCA layer only
    the compressor)."""

    positions: torch.Tensor  # [T], absolute, consecutive
    prompt_tokens: int  # the prompt's length while its positions are computed, 0 for a decode step

    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Append the chunk's K = V rows ``kv`` [T, head_dim] of ``layer``; return the rows from position
        ``first`` on that this chunk's queries may see (the ``sliding_window - 1`` before the chunk, then the chunk),
        and ``first``."""
        ...

    def pool(
        self, layer: int, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add the chunk's projected ``kv`` / ``gate`` rows to the compressor's partial window; return the rows of
        the windows now complete (a multiple of its rate) and the absolute position of their first row."""
        ...

    def overlap(
        self, layer: int, name: str, first: int, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """CSA's overlap state: ``kv`` / ``gate`` [n, rate, width] are the first series of the windows just
        completed (from position ``first``; gates with the position bias added). Keep the last one for the next
        chunk and return the one kept before (None at the sequence's first window)."""
        ...

    def entries(self, layer: int, name: str, new: torch.Tensor) -> torch.Tensor:
        """Keep the newly pooled entries ``new`` [n, width]; return every entry of the sequence so far [N, width]."""
        ...

    def topk_row(self, rate: int) -> int:
        """How many entries a query's indexer scores are taken over (the extra ones ``-inf``): as many as a
        whole-prompt forward holds when the query is in the prompt, so ties fall as they do there."""
        ...


class Batch:
    """Several sequences' :class:`V4KV` in one forward: rows ``lo … hi-1`` of its chunk are ``parts[i]``'s
    (``segments``), ``positions`` theirs concatenated."""

    def __init__(self, parts: list[V4KV]) -> None:
        self.positions = torch.cat([p.positions for p in parts])
        self.segments: list[tuple[V4KV, int, int]] = []
        row = 0
        for p in parts:
            self.segments.append((p, row, row + p.positions.shape[0]))
            row += p.positions.shape[0]


class RMSNorm(LlamaRMSNorm):
    """V4's RMSNorm: the weight is applied in float32, then cast back (Llama's casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * self.normalized(x)).to(x.dtype)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_tables(rope: RopeSet, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin [T, dim/2] (one per interleaved pair) of ``positions``."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    return (freqs.cos() * rope.attention_scaling).to(dtype), (freqs.sin() * rope.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 × cos.shape[-1]`` channels of ``x`` [T, ..., D] (cos/sin [T, dim/2]),
    in float32; the leading channels are left as they are."""
    extra = x.dim() - 2
    cos = cos.repeat_interleave(2, dim=-1).view(cos.shape[0], *([1] * extra), -1)
    sin = sin.repeat_interleave(2, dim=-1).view(sin.shape[0], *([1] * extra), -1)
    dim = cos.shape[-1]
    nope, rope = x[..., :-dim], x[..., -dim:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, ((rope.float() * cos) + (rotated.float() * sin)).to(x.dtype)], dim=-1)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """One entry per window: kv / gate [n, width, D] → norm(Σ softmax(gate) ⊙ kv) [n, D] (softmax in float32)."""
    return norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))


class Compressor(nn.Module):
    """A layer's compressor (§2.3.1 eqs. 9–12 for CSA, §2.3.2 eqs. 20–23 for HCA), also the indexer's own.

    ``overlapping``: CSA's two series (``kv_proj`` emits ``2 × width`` per token: Ca ``[:width]`` feeds the next
    window's entry, Cb ``[width:]`` this window's), so entry ``w`` pools ``2 × rate`` rows: window ``w−1``'s Ca and
    window ``w``'s Cb. HCA pools its own ``rate`` rows. Each entry gets RoPE (``compress`` set) at the position of
    its window's first token."""

    def __init__(self, config: V4Config, rate: int, width: int, overlapping: bool) -> None:
        super().__init__()
        self.rate, self.width, self.overlapping = rate, width, overlapping
        series = 2 if overlapping else 1
        self.kv_proj = nn.Linear(config.hidden_size, series * width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, series * width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, series * width, dtype=torch.float32))
        self.kv_norm = RMSNorm(width, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows a chunk adds (of every sequence in a batch: one matmul each): ``kv`` and ``gate``."""
        return self.kv_proj(x), self.gate_proj(x)

    def forward(
        self,
        projected: tuple[torch.Tensor, torch.Tensor],
        kv_state: V4KV,
        layer: int,
        name: str,
        rope: RopeSet,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """Every entry of one sequence so far [N, width], after pooling what its chunk completes (``projected``:
        :meth:`project`'s rows of that sequence)."""
        rate, width = self.rate, self.width
        chunk_kv, chunk_gate, first = kv_state.pool(layer, name, *projected)
        n = chunk_kv.shape[0] // rate
        if n == 0:
            return kv_state.entries(layer, name, chunk_kv.new_zeros((0, width)))
        chunk_kv = chunk_kv.view(n, rate, -1)
        chunk_gate = chunk_gate.view(n, rate, -1) + self.position_bias
        if self.overlapping:
            kv = chunk_kv.new_zeros((n, 2 * rate, width))
            gate = chunk_gate.new_full((n, 2 * rate, width), float("-inf"))
            kv[:, rate:], gate[:, rate:] = chunk_kv[..., width:], chunk_gate[..., width:]
            kv[1:, :rate], gate[1:, :rate] = chunk_kv[:-1, :, :width], chunk_gate[:-1, :, :width]
            prior = kv_state.overlap(layer, name, first, chunk_kv[..., :width], chunk_gate[..., :width])
            if prior is not None:
                kv[0, :rate], gate[0, :rate] = prior[0].to(kv.dtype), prior[1].to(gate.dtype)
            chunk_kv, chunk_gate = kv, gate
        pooled = pool_windows(chunk_kv, chunk_gate, self.kv_norm)
        positions = torch.arange(n, device=pooled.device) * rate + first
        cos, sin = rope_tables(rope, inv_freq, positions, pooled.dtype)
        return kv_state.entries(layer, name, apply_rope(pooled, cos, sin))


class Indexer(nn.Module):
    """The lightning indexer (§2.3.1 eqs. 13–17): its own compressor at ``index_head_dim`` over CSA's windows,
    queries from the attention's low-rank query, scores ``Σ_h w_h · ReLU(q_h · k) / √(c·n)``; each query keeps its
    ``index_topk`` best entries among those whose window ended at or before it."""

    SCORE_ELEMENTS = 1 << 27  # scores [queries, heads, entries] held at once off the CPU

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.rate, self.heads, self.head_dim = config.csa_rate, config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.compressor = Compressor(config, config.csa_rate, config.index_head_dim, overlapping=True)
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)
        self.softmax_scale = config.index_head_dim**-0.5
        self.weights_scaling = config.index_n_heads**-0.5

    def scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, exact: bool) -> torch.Tensor:
        """Index scores [T, N] of queries ``q`` [T, H, c] against ``keys`` [N, c] (``weights`` [T, H]): ``exact``
        as transformers computes them (float32, every head at once: its rounding, so ties fall as there), else in
        the compute dtype a slice of queries at a time ([T, H, N] is 17 GB at 128K tokens)."""
        if exact:
            s = torch.matmul(q.float(), keys.transpose(0, 1).float())  # [T, H, N]
            return (F.relu(s) * self.softmax_scale * weights[..., None]).sum(dim=1)
        out = torch.empty(q.shape[0], keys.shape[0], dtype=torch.float32, device=q.device)
        step = max(1, self.SCORE_ELEMENTS // (self.heads * keys.shape[0]))
        keys_t = keys.transpose(0, 1)
        scaled = (weights * self.softmax_scale).to(q.dtype)[:, None, :]  # [T, 1, H]
        for lo in range(0, q.shape[0], step):
            s = torch.matmul(q[lo : lo + step], keys_t).relu_()  # [t, H, N]
            out[lo : lo + step] = torch.bmm(scaled[lo : lo + step], s)[:, 0]  # the heads summed as a matmul
        return out

    def project(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """What a chunk's rows give the indexer (of every sequence in a batch: one matmul each): its compressor's
        ``kv`` and ``gate`` rows, the queries [T, H, D] and the head weights [T, H]."""
        t = x.shape[0]
        q = apply_rope(self.q_b_proj(q_residual).view(t, self.heads, self.head_dim), cos, sin)
        weights = self.weights_proj(x).float() * self.weights_scaling
        return *self.compressor.project(x), q, weights

    def forward(
        self,
        projected: tuple[torch.Tensor, ...],
        kv_state: V4KV,
        layer: int,
        rope: RopeSet,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """Per query of one sequence, the indices [T, k'] of its chosen entries, ``-1`` where it has fewer than k'
        to choose from (``projected``: :meth:`project`'s rows of that sequence)."""
        kv, gate, q, weights = projected
        keys = self.compressor((kv, gate), kv_state, layer, INDEXER, rope, inv_freq)
        t, n = q.shape[0], keys.shape[0]
        row = max(n, kv_state.topk_row(self.rate))
        scores = torch.full((t, row), float("-inf"), dtype=torch.float32, device=q.device)
        if n:
            scores[:, :n] = self.scores(q, keys, weights, exact=q.device.type == "cpu")
        threshold = (kv_state.positions + 1) // self.rate  # entries w < threshold have a complete window
        scores.masked_fill_(torch.arange(row, device=q.device)[None, :] >= threshold[:, None], float("-inf"))
        picked = scores.topk(min(self.topk, row), dim=-1).indices
        return torch.where(picked >= threshold[:, None], torch.full_like(picked, -1), picked)


class Attention(nn.Module):
    def __init__(self, config: V4Config, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.kind = config.layer_types[layer]
        self.heads, self.head_dim = config.num_heads, config.head_dim
        self.window = config.sliding_window
        self.scaling = config.head_dim**-0.5
        h = config.hidden_size
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.num_heads * config.head_dim, bias=False)
        self.kv_proj = nn.Linear(h, config.head_dim, bias=False)
        self.kv_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        group_in = config.num_heads * config.head_dim // config.o_groups
        self.o_a_proj = nn.Linear(group_in, config.o_groups * config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind == CSA:
            self.compressor = Compressor(config, config.csa_rate, config.head_dim, overlapping=True)
            self.indexer = Indexer(config)
        elif self.kind == HCA:
            self.compressor = Compressor(config, config.hca_rate, config.head_dim, overlapping=False)

    def forward(self, x: torch.Tensor, rope: RoPEs, kv_state: V4KV | Batch) -> torch.Tensor:
        """The attention output of a chunk's rows [T, hidden]: of one sequence, or of every sequence of a
        :class:`Batch` (projections once over all rows; each sequence's window, compressors, indexer and scores
        with its own state, rows and prompt as alone)."""
        t, eps = x.shape[0], self.config.rms_norm_eps
        rope_set, inv_freq, cos, sin = rope.for_layer(self.kind)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_residual).view(t, self.heads, self.head_dim), eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, D]: the one K = V head
        compressed = self.compressor.project(x) if self.compressor is not None else ()
        indexed = self.indexer.project(x, q_residual, cos, sin) if self.indexer is not None else ()
        outs = []
        for state, lo, hi in kv_state.segments if isinstance(kv_state, Batch) else [(kv_state, 0, t)]:
            keys, first = state.window(self.layer, kv[lo:hi])
            entries = chosen = None
            if self.compressor is not None:
                part = tuple(p[lo:hi] for p in compressed)
                entries = self.compressor(part, state, self.layer, COMPRESSOR, rope_set, inv_freq)
                if self.indexer is not None:
                    part = tuple(p[lo:hi] for p in indexed)
                    chosen = self.indexer(part, state, self.layer, rope_set, inv_freq)
            args = (q[lo:hi], keys, first, state.positions, entries, chosen)
            outs.append(self._attend_rows(*args, state.prompt_tokens) if q.is_cpu else self._attend(*args))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        out = apply_rope(out, cos, -sin)  # K = V carried RoPE into the output: rotate it back (§2.3.1)
        grouped = out.reshape(t, self.config.o_groups, -1)
        w = self.o_a_proj.weight.view(self.config.o_groups, -1, grouped.shape[-1])
        grouped = torch.bmm(grouped.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)  # [T, groups, rank]
        return self.o_b_proj(grouped.reshape(t, -1))

    ROW_ELEMENTS = 1 << 25  # score elements per slice of queries in :meth:`_attend_rows`
    MIN_ROWS = 64  # queries per slice at least: fewer take the BLAS's small-matrix paths, which round differently

    def _attend_rows(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        first: int,
        positions: torch.Tensor,
        entries: torch.Tensor | None,
        chosen: torch.Tensor | None,
        prompt_tokens: int,
    ) -> torch.Tensor:
        """:meth:`_attend` with each score row laid out as transformers' eager attention lays it (so sums round as
        there, and an indexer tie after this layer breaks the same way): a prompt query's row is every prompt
        position (the window visible), then as many entries as the whole prompt pools, then the sink; a decode
        step's row is its window (``min(p + 1, W)`` positions), the entries so far, the sink. Positions and entries
        a chunk does not have yet are masked columns, so a position's row is the same in any chunking. Queries go
        in slices of at least :data:`MIN_ROWS` (all of them when fewer), as many as :data:`ROW_ELEMENTS` allows."""
        t, heads, dim = q.shape
        if prompt_tokens:
            lo, width = 0, prompt_tokens
        else:
            p = int(positions[-1])
            lo, width = max(0, p - self.window + 1), min(p + 1, self.window)
        k_pos = torch.arange(lo, lo + width, device=q.device)
        columns = keys.new_zeros(width, dim)
        held = torch.arange(first, first + keys.shape[0], device=q.device)
        inside = (held >= lo) & (held < lo + width)
        columns[held[inside] - lo] = keys[inside]
        mask = (k_pos[None, :] > positions[:, None]) | (k_pos[None, :] <= positions[:, None] - self.window)
        mask |= k_pos[None, :] < first  # not held: before a bounded replay's first position
        if entries is not None:
            rate = self.config.csa_rate if chosen is not None else self.config.hca_rate
            total = max(entries.shape[0], prompt_tokens // rate)
            pooled = entries.new_zeros(total, dim)
            pooled[: entries.shape[0]] = entries
            if chosen is None:
                hidden = torch.arange(total, device=q.device)[None, :] >= ((positions + 1) // rate)[:, None]
            else:
                hidden = torch.ones(t, total + 1, dtype=torch.bool, device=q.device)
                hidden.scatter_(1, torch.where(chosen >= 0, chosen, total), False)
                hidden = hidden[:, :total]
            columns, mask = torch.cat([columns, pooled]), torch.cat([mask, hidden], dim=1)
        values = columns[None, None].expand(1, heads, -1, -1).reshape(1, heads, columns.shape[0], dim)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(mask, -math.inf)
        step = max(self.MIN_ROWS, self.ROW_ELEMENTS // (heads * columns.shape[0]))
        cuts = list(range(0, t, step))
        if len(cuts) > 1 and t - cuts[-1] < self.MIN_ROWS:
            cuts.pop()  # the last slice takes the short rest
        out = []
        for lo, hi in zip(cuts, [*cuts[1:], t], strict=True):
            query = q[lo:hi].transpose(0, 1)[None]
            scores = torch.matmul(query, values.transpose(2, 3)) * self.scaling + bias[lo:hi]
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(1, -1, hi - lo, -1)
            combined = torch.cat([scores, sinks.to(scores.dtype)], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(values.dtype)
            out.append(torch.matmul(probs, values)[0].transpose(0, 1))
        return torch.cat(out)

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        first: int,
        positions: torch.Tensor,
        entries: torch.Tensor | None,
        chosen: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of ``q`` [T, H, D] over its window of ``keys`` (K = V, positions ``first…``) and, on a
        compressed layer, the compressed ``entries`` it may see (HCA: those whose window ended at or before it;
        CSA: ``chosen``), with a sink logit per head. Returns [T, H, D].

        Each query's keys are laid out the same way whatever chunk it is computed in (its ``W`` window rows
        gathered oldest first, then the entries by index or in the indexer's order, the sink apart), so a position
        gives bitwise the same output computed whole, in chunks or as a decode step; and no ``T × S`` score matrix
        is built (the window is ``T × W``, the entries ``T × N`` for HCA and ``T × k`` for CSA)."""
        w = self.window
        at = positions[:, None] - w + 1 + torch.arange(w, device=q.device)[None, :]  # [T, W]: window positions
        window = keys[(at - first).clamp(min=0)]  # [T, W, D]; positions before ``first`` are not held (replay)
        hidden = (at < max(first, 0))[:, None, :]
        parts = [torch.einsum("thd,twd->thw", q, window).mul_(self.scaling).masked_fill_(hidden, -math.inf)]
        values = [window]
        if entries is not None and entries.shape[0]:
            if chosen is None:  # HCA: every entry whose window is complete
                seen = (
                    torch.arange(entries.shape[0], device=q.device)[None, :]
                    < ((positions + 1) // self.config.hca_rate)[:, None]
                )
                c = torch.einsum("thd,nd->thn", q, entries).mul_(self.scaling)
                parts.append(c.masked_fill_(~seen[:, None, :], -math.inf))
                values.append(entries)
            else:  # CSA: the indexer's picks
                picked = entries[chosen.clamp(min=0)]  # [T, k, D]
                c = torch.einsum("thd,tkd->thk", q, picked).mul_(self.scaling)
                parts.append(c.masked_fill_((chosen < 0)[:, None, :], -math.inf))
                values.append(picked)
        parts = [p.float() for p in parts]  # the softmax in float32 whatever the compute dtype
        sink = self.sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        top = torch.stack([sink[..., 0], *(p.max(dim=-1).values for p in parts)]).max(dim=0).values[..., None]
        exps = [(p - top).exp() for p in parts]
        total = (sink - top).exp()[..., 0]
        for e in exps:
            total = total + e.sum(dim=-1)
        out = torch.zeros_like(q)
        for e, v in zip(exps, values, strict=True):
            probs = (e / total[..., None]).to(v.dtype)
            out = out + (
                torch.einsum("thk,tkd->thd", probs, v) if v.dim() == 3 else torch.einsum("thn,nd->thd", probs, v)
            )
        return out


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connections (§2.2): ``hc_mult`` residual streams; per token, ``pre`` collapses
    them into the block's input, ``post`` spreads the block's output back, and ``comb`` (projected towards a
    doubly-stochastic matrix by Sinkhorn-Knopp) mixes the streams. All in float32."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = (
            config.hc_mult,
            config.hc_sinkhorn_iters,
            config.hc_eps,
            config.rms_norm_eps,
        )
        n = (2 + config.hc_mult) * config.hc_mult
        self.fn = nn.Parameter(torch.zeros(n, config.hc_mult * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams`` [T, hc, D] → (post [T, hc], comb [T, hc, hc], collapsed [T, D])."""
        hc = self.hc
        mixed = F.linear(unweighted_rms(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """The final collapse of the streams before the model's norm."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(config.hc_mult, config.hc_mult * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(config.hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class SharedExpert(nn.Module):
    def __init__(self, config: V4Config) -> None:
        super().__init__()
        h, i, b = config.hidden_size, config.moe_intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """The routed experts as 3-D weights (``gate_up_proj`` [E, 2I, H]: gate rows then up rows; ``down_proj``
    [E, H, I]), clamped SwiGLU. Computed as transformers' grouped path does (token-slots sorted by expert, one
    grouped matmul per projection, each token's slots summed in slot order), so the sums round alike."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        tokens, k = index.shape
        experts, perm = torch.sort(index.reshape(-1))
        rows = x[perm // k]
        offsets = torch.cumsum(torch.bincount(experts, minlength=self.gate_up_proj.shape[0]), 0).to(torch.int32)
        gate, up = _grouped_linear(rows, self.gate_up_proj, offsets).chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        out = _grouped_linear(h, self.down_proj, offsets) * weight.reshape(-1)[perm].unsqueeze(-1)
        unsort = torch.empty_like(perm)
        unsort[perm] = torch.arange(perm.shape[0], device=perm.device)
        return out[unsort].view(tokens, k, -1).sum(dim=1).to(x.dtype)


def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows`` (sorted by group, group ``g`` ending at ``offsets[g]``) times ``weight[g]ᵀ`` each: one grouped
    matmul where torch has it for this device and dtype, else one matmul per group."""
    weight_t = weight.transpose(-2, -1)
    grouped = getattr(F, "grouped_mm", None)
    if grouped is not None and (rows.device.type == "cpu" or rows.dtype == torch.bfloat16):
        try:
            return grouped(rows.to(weight.dtype), weight_t, offs=offsets)
        except (RuntimeError, NotImplementedError, ValueError, TypeError):
            pass  # this build, device or layout has no kernel for it
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = F.linear(rows[start:end], weight[g])
        start = end
    return out


class Router(nn.Module):
    """Chooses each token's experts: by ``tid2eid[token]`` (hash MoE, §2.1) or by top-k of the scores plus a
    correction bias; the weights are the chosen scores, normalised, times ``routed_scaling_factor``."""

    def __init__(self, config: V4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.k, self.scale = hashed, config.num_experts_per_tok, config.routed_scaling_factor
        self.scoring = config.scoring_func
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.k, dtype=torch.long))
        else:
            bias = torch.zeros(config.n_routed_experts, dtype=torch.float32)
            self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.hashed:
            index = self.tid2eid[tokens].long()
        else:
            index = torch.topk(scores + self.e_score_correction_bias, self.k, dim=-1, sorted=False).indices
        weight = scores.gather(1, index)
        weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weight * self.scale


class MoE(nn.Module):
    def __init__(self, config: V4Config, layer: int) -> None:
        super().__init__()
        self.gate = Router(config, config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(config)
        self.shared_experts = SharedExpert(config)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        index, weight = self.gate(x, tokens)
        return self.experts(x, index, weight) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: V4Config, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MoE(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, tokens: torch.Tensor, rope: RoPEs, kv_state: V4KV | Batch) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = _mix(post, comb, self.self_attn(self.input_layernorm(x), rope, kv_state), streams)
        post, comb, x = self.ffn_hc(streams)
        return _mix(post, comb, self.mlp(self.post_attention_layernorm(x), tokens), streams)


def _mix(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """A block's output spread over the streams by ``post``, plus the streams mixed by ``comb`` (transposed:
    stream k takes the sum over j of comb[j, k] times stream j)."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class RoPEs:
    """The ``main`` and ``compress`` cos/sin of one chunk's positions."""

    def __init__(self, model: DeepseekV4, positions: torch.Tensor, dtype: torch.dtype) -> None:
        c = model.config
        main, compress = (c.rope_main, model.main_inv_freq), (c.rope_compress, model.compress_inv_freq)
        self._sets = {
            SLIDING: (*main, *rope_tables(*main, positions, dtype)),
            "compress": (*compress, *rope_tables(*compress, positions, dtype)),
        }

    def for_layer(self, kind: str) -> tuple[RopeSet, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._sets[SLIDING if kind == SLIDING else "compress"]


class Decoder(nn.Module):
    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)


class DeepseekV4(nn.Module):
    """The whole model. ``forward`` runs one chunk of one sequence (``kv_state`` holds everything before it), or of
    several (a :class:`Batch`: their rows concatenated)."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("main_inv_freq", config.rope_main.tensor(), persistent=False)
        self.register_buffer("compress_inv_freq", config.rope_compress.tensor(), persistent=False)

    def reset_buffers(self) -> None:
        """Compute the buffers a checkpoint does not hold (RoPE's frequencies), e.g. after building on ``meta``."""
        self.main_inv_freq = self.config.rope_main.tensor()
        self.compress_inv_freq = self.config.rope_compress.tensor()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv_state: V4KV | Batch) -> torch.Tensor:
        """Final hidden states [T, hidden] of ``tokens`` at absolute ``positions`` (both [T])."""
        x = self.model.embed_tokens(tokens)
        rope = RoPEs(self, positions, x.dtype)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, tokens, rope, kv_state)
        return self.model.norm(self.model.hc_head(streams))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
