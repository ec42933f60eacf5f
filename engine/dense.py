"""One full forward without cache or store: the reference every cached and reused path is checked against."""

from __future__ import annotations

import torch
from torch import nn

from kvtier.engine.family import FAMILIES


@torch.inference_mode()
def forward_logits(model: nn.Module, tokens: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one sequence, computed in chunks of queries (bounded memory; the model family
    may choose otherwise: DeepSeek-V4 on the CPU runs the whole sequence as transformers does), with everything each
    chunk's attention needs held contiguous (the family's reference context)."""
    family = FAMILIES[model.config.family]
    chunk = family.reference(model, len(tokens))
    chunk_tokens = family.reference_chunk(tokens.device, chunk_tokens)
    out = []
    for start in range(0, len(tokens), chunk_tokens):
        piece = tokens[start : start + chunk_tokens]
        positions = torch.arange(start, start + len(piece), device=tokens.device)
        out.append(model.logits(model(piece, positions, chunk(positions))))
    return torch.cat(out)
