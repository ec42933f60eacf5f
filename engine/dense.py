"""One full forward without cache or store: the reference every cached and reused path is checked against."""

from __future__ import annotations

import torch

from kvtier.engine.model import CausalLM, attention


class DenseKV:
    """Every layer's keys and values of one sequence, contiguous, grown chunk by chunk."""

    def __init__(self, model: CausalLM) -> None:
        self.windows = model.windows()
        self.k: list[torch.Tensor | None] = [None] * len(self.windows)
        self.v: list[torch.Tensor | None] = [None] * len(self.windows)
        self.q_pos = torch.empty(0, dtype=torch.long)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        old_k, old_v = self.k[layer], self.v[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat((old_k, k)), torch.cat((old_v, v))
        self.k[layer], self.v[layer] = k, v
        k_pos = torch.arange(k.shape[0], device=q.device)
        return attention(q, k, v, self.q_pos, k_pos, self.windows[layer])


@torch.inference_mode()
def forward_logits(model: CausalLM, tokens: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one sequence, computed in chunks of queries (bounded memory)."""
    kv = DenseKV(model)
    out = []
    for start in range(0, len(tokens), chunk_tokens):
        piece = tokens[start : start + chunk_tokens]
        kv.q_pos = torch.arange(start, start + len(piece), device=tokens.device)
        out.append(model.logits(model(piece, kv.q_pos, kv)))
    return torch.cat(out)
