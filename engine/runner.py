"""Runs the model over spans of sequences' positions against their pages and their states (what a StateBlock
holds), in whatever form the model's family keeps them (``family.py``): one sequence (:meth:`Runner.run`) or a
batch of them in one forward (:meth:`Runner.forward`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from kvtier.engine.family import Family, Pages
from kvtier.engine.sequence import Sequence
from kvtier.engine.sliding import STATE_INTERVAL


@dataclass
class Work:
    """What one sequence computes in a forward: positions ``start … end-1`` of ``seq.tokens`` (see
    :meth:`Runner.run` for the rest)."""

    seq: Sequence
    start: int
    end: int
    write_global: bool = True
    state_at: Collection[int] = ()
    on_state: Callable[[int], None] | None = None


class Runner:
    """Chunked forward passes (``chunk_tokens`` queries of a sequence at a time, chunks ending on multiples of
    ``chunk_tokens`` so that equal prefixes are computed in equal pieces)."""

    def __init__(self, model: nn.Module, cache: Pages, family: Family, chunk_tokens: int = 512) -> None:
        if chunk_tokens % STATE_INTERVAL:
            raise ValueError(f"chunk_tokens must be a multiple of {STATE_INTERVAL}")
        self.model, self.cache, self.family, self.chunk_tokens = model, cache, family, chunk_tokens

    def pages_short(self, seq: Sequence, length: int) -> int:
        """Pages ``seq`` needs beyond those it holds for its first ``length`` positions."""
        return max(0, -(-length // self.cache.block_tokens) - len(seq.pages))

    def ensure_pages(self, seq: Sequence, length: int) -> None:
        need = self.pages_short(seq, length)
        if need > 0:
            seq.pages.extend(self.cache.allocate(need))

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
        return self.forward([Work(seq, start, end, write_global, state_at, on_state)])[0]

    @torch.inference_mode()
    def forward(self, works: list[Work]) -> list[torch.Tensor]:
        """Compute every work's span (one sequence each); returns the logits of each span's last position, in
        order. The spans are cut at chunk boundaries and the ``i``-th pieces of all spans run as one forward
        (a decode step's one token is a first piece), so the layers run once for the whole batch however many
        sequences it holds. Each sequence's pages are allocated as needed (CacheFullError when there are none:
        a scheduler allocates them beforehand)."""
        device = self.cache.pages.device
        pieces, tables, tokens = [], [], []
        for w in works:
            self.ensure_pages(w.seq, w.end)
            cuts = [w.start]
            while cuts[-1] < w.end:
                cuts.append(min(w.end, (cuts[-1] // self.chunk_tokens + 1) * self.chunk_tokens))
            pieces.append(list(itertools.pairwise(cuts)))
            tables.append(w.seq.table(device))
            tokens.append(torch.tensor(w.seq.tokens[w.start : w.end], dtype=torch.long).to(device, non_blocking=True))
        assert all(pieces), "an empty span has no logits"
        last: list[torch.Tensor | None] = [None] * len(works)
        for r in range(max(len(p) for p in pieces)):
            active = [i for i, p in enumerate(pieces) if r < len(p)]
            contexts, chunk, marks_of = [], [], []
            for i in active:
                w, (lo, hi) = works[i], pieces[i][r]
                marks = sorted(m for m in w.state_at if lo < m <= hi) if w.on_state is not None else []
                marks_of.append(marks)
                contexts.append(
                    self.family.context(self.model, self.cache, w.seq, tables[i], (lo, hi), w.write_global, marks)
                )
                chunk.append(tokens[i][lo - w.start : hi - w.start])
            ctx = contexts[0] if len(contexts) == 1 else self.family.batch(self.model, self.cache, contexts)
            hidden = self.model(chunk[0] if len(chunk) == 1 else torch.cat(chunk), ctx.positions, ctx)
            row = 0
            for i, piece, marks in zip(active, chunk, marks_of, strict=True):
                row += piece.shape[0]
                w = works[i]
                for m in marks:
                    assert w.on_state is not None
                    w.on_state(m)
                w.seq.state.trim()
                if r == len(pieces[i]) - 1:
                    last[i] = hidden[row - 1]
        logits = self.model.logits(torch.stack(last))  # type: ignore[arg-type]
        return list(logits)
