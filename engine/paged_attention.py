"""Decode attention straight from the pages, on the GPU: one query per sequence against its keys and values where
they lie (``paged_cache``'s layout: ``[page][global layer][K | V][token][kv head][head dim]``), each byte of KV read
once, no gathered copy. A Triton kernel (Triton ships with CUDA builds of torch: nothing to install).

A program is one sequence and one kv head: its query heads (the GQA group) against the sequence's pages one at a
time, with the online softmax of flash attention (running max, running sum, rescaled accumulator in float32).
Without Triton (a CPU build of torch) :data:`available` is False and the engine gathers the pages instead;
``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors (how the tests check it without a GPU).
"""

from __future__ import annotations

import importlib.util

import torch

available = importlib.util.find_spec("triton") is not None

if available:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        length_ptr,
        out_ptr,
        q_seq,
        q_head,
        kv_page,
        kv_token,
        kv_head,
        table_seq,
        out_seq,
        out_head,
        scale,
        GROUP: tl.constexpr,
        BLOCK_GROUP: tl.constexpr,
        PAGE: tl.constexpr,
        DIM: tl.constexpr,
    ):
        seq, head = tl.program_id(0), tl.program_id(1)
        g, d, t = tl.arange(0, BLOCK_GROUP), tl.arange(0, DIM), tl.arange(0, PAGE)
        in_group = g < GROUP
        heads = head * GROUP + g
        q = tl.load(q_ptr + seq * q_seq + heads[:, None] * q_head + d[None, :], mask=in_group[:, None], other=0.0)
        length = tl.load(length_ptr + seq)
        top = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_GROUP], tl.float32)
        acc = tl.zeros([BLOCK_GROUP, DIM], tl.float32)
        for p in range(0, tl.cdiv(length, PAGE)):
            page = tl.load(table_ptr + seq * table_seq + p).to(tl.int64)
            held = p * PAGE + t < length
            at = page * kv_page + head * kv_head + t[:, None] * kv_token + d[None, :]
            k = tl.load(k_ptr + at, mask=held[:, None], other=0.0)
            v = tl.load(v_ptr + at, mask=held[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [group, page]
            s = tl.where(held[None, :], s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            weights = tl.exp(s - new_top[:, None])
            rescale = tl.exp(top - new_top)
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            top = new_top
        out = acc / total[:, None]
        tl.store(out_ptr + seq * out_seq + heads[:, None] * out_head + d[None, :], out, mask=in_group[:, None])


def paged_decode(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Attention of ``q`` [B, H, D] (one query per sequence, the last of its ``lengths[b]`` positions) over the
    keys and values of positions ``0 … lengths[b]-1``, read from the pages ``tables[b]`` lists in order: ``keys``
    and ``values`` are one global layer's K and V of every page, ``[pages, tokens per page, kv heads, D]`` (views of
    the cache: ``cache.pages[:, g, 0]`` and ``[:, g, 1]``, strided). Returns [B, H, D]. Needs :data:`available`."""
    b, heads, dim = q.shape
    kv_heads, page = keys.shape[2], keys.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    assert keys.stride() == values.stride() and keys.stride(-1) == 1 and dim & (dim - 1) == 0
    _decode[(b, kv_heads)](
        q, keys, values, tables, lengths, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), tables.stride(0),
        out.stride(0), out.stride(1), dim**-0.5,
        GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), PAGE=page, DIM=dim,
    )  # fmt: skip
    return out
