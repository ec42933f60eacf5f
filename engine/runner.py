"""Runs the model over a span of one sequence's positions against its pages and its state (what a StateBlock
holds), in whatever form the model's family keeps them (``family.py``)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from kvtier.engine.family import Family, Pages
from kvtier.engine.sequence import Sequence
from kvtier.engine.sliding import STATE_INTERVAL


class Runner:
    """Chunked forward passes (``chunk_tokens`` queries at a time, chunks ending on multiples of
    ``chunk_tokens`` so that equal prefixes are computed in equal pieces)."""

    def __init__(self, model: nn.Module, cache: Pages, family: Family, chunk_tokens: int = 512) -> None:
        if chunk_tokens % STATE_INTERVAL:
            raise ValueError(f"chunk_tokens must be a multiple of {STATE_INTERVAL}")
        self.model, self.cache, self.family, self.chunk_tokens = model, cache, family, chunk_tokens

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

        Positions before ``start`` must be in the pages and the sequence's state. ``on_state(m)`` is called for
        every ``m`` of ``state_at`` in ``start+1 … end`` while the state at ``m`` can be cut (``seq.state``'s
        ``state_block(m)``). ``write_global`` off: reused block KV is read, not rewritten (bounded replay).
        """
        self.ensure_pages(seq, end)
        device = self.cache.pages.device
        tokens = torch.tensor(seq.tokens[start:end], dtype=torch.long).to(device, non_blocking=True)
        table = seq.table(device)
        hidden = None
        pos = start
        while pos < end:
            stop = min(end, (pos // self.chunk_tokens + 1) * self.chunk_tokens)
            marks = sorted(m for m in state_at if pos < m <= stop) if on_state is not None else []
            ctx = self.family.context(self.model, self.cache, seq, table, (pos, stop), write_global, marks)
            hidden = self.model(tokens[pos - start : stop - start], ctx.positions, ctx)
            for m in marks:
                assert on_state is not None
                on_state(m)
            seq.state.trim()
            pos = stop
        assert hidden is not None, "an empty span has no logits"
        return self.model.logits(hidden[-1:])[0]
