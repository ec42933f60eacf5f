"""Runs the model over a span of one sequence's positions against its paged cache and sliding state."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from kvtier.engine.model import CausalLM, attention, causal_attention
from kvtier.engine.paged_cache import PagedKVCache
from kvtier.engine.sequence import Sequence
from kvtier.engine.sliding import STATE_INTERVAL


class PagedContext:
    """The :class:`~kvtier.engine.model.KVContext` of one chunk: global layers write their keys and values to
    the sequence's pages (unless ``write_global`` is off: bounded replay reads the reused KV as is) and attend
    to every position up to the query; sliding layers attend within their window of the sliding state."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        seq: Sequence,
        table: torch.Tensor,
        span: tuple[int, int],
        write_global: bool,
    ):
        self.windows = model.windows()
        self.cache, self.seq, self.table, self.write_global = cache, seq, table, write_global
        self.end = span[1]  # a Python int: reading a device tensor's value would wait for the device
        self.positions = torch.arange(*span, device=cache.pages.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window = self.windows[layer]
        if window is not None:
            keys, values, k_pos = self.seq.sliding.extend(layer, k, v)
            return attention(q, keys, values, self.positions, k_pos, window)
        if self.write_global:
            self.cache.write(layer, self.table, self.positions, k, v)
        keys, values = self.cache.read(layer, self.table, self.end)
        return causal_attention(q, keys, values)


class Runner:
    """Chunked forward passes (``chunk_tokens`` queries at a time, chunks ending on multiples of
    ``chunk_tokens`` so that equal prefixes are computed in equal pieces)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, chunk_tokens: int = 512) -> None:
        if chunk_tokens % STATE_INTERVAL:
            raise ValueError(f"chunk_tokens must be a multiple of {STATE_INTERVAL}")
        self.model, self.cache, self.chunk_tokens = model, cache, chunk_tokens

    def ensure_pages(self, seq: Sequence, length: int) -> None:
        need = -(-length // self.cache.block_tokens) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.cache.allocate(need))

    @torch.inference_mode()
    def run(
        self,
        seq: Sequence,
        start: int,
        end: int,
        write_global: bool = True,
        state_at: Collection[int] = (),
        on_state: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Compute positions ``start … end-1`` of ``seq.tokens``; returns the logits of position ``end-1``.

        Positions before ``start`` must be in the pages (global layers) and the sliding state. ``on_state(m)``
        is called for every ``m`` of ``state_at`` in ``start+1 … end`` while the sliding state at ``m`` is held.
        """
        self.ensure_pages(seq, end)
        device = self.cache.pages.device
        tokens = torch.tensor(seq.tokens[start:end], dtype=torch.long).to(device, non_blocking=True)
        table = seq.table(device)
        hidden = None
        pos = start
        while pos < end:
            stop = min(end, (pos // self.chunk_tokens + 1) * self.chunk_tokens)
            ctx = PagedContext(self.model, self.cache, seq, table, (pos, stop), write_global)
            hidden = self.model(tokens[pos - start : stop - start], ctx.positions, ctx)
            if on_state is not None:
                for m in sorted(m for m in state_at if pos < m <= stop):
                    on_state(m)
            seq.sliding.trim()
            pos = stop
        assert hidden is not None, "an empty span has no logits"
        return self.model.logits(hidden[-1:])[0]
