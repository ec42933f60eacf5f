"""One request as it moves through the engine: its tokens, its pages, its state and what reuse did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Sequence:
    prompt: list[int]
    ids: np.ndarray  # the prompt as uint32, converted once (what keys are chained over)
    state: Any = None  # the family's SequenceState: what a StateBlock holds (set by the engine)
    pages: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    hit_tokens: int = 0  # prompt tokens whose KV came from the store
    replayed: bool = False  # the state was rebuilt approximately (bounded replay): nothing of this sequence is stored
    publishing: bool = False  # exactly computed with a store: its new blocks and StateBlocks are kept
    ttft_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    # tokens computed as a prompt (in prefill chunks, the last one's logits choosing the next token): the prompt,
    # or after a preemption every token so far (0: the prompt)
    prefill: int = 0

    def __post_init__(self) -> None:
        self.prefill = self.prefill or len(self.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    def prefill_ids(self) -> np.ndarray:
        """The ``prefill`` tokens as uint32 (what block keys are chained over)."""
        if self.prefill == len(self.prompt):
            return self.ids
        return np.concatenate((self.ids, np.asarray(self.generated, dtype=np.uint32)))[: self.prefill]

    def table(self, device: torch.device | str) -> torch.Tensor:
        """The page table on ``device``, uploaded without waiting for the device's queue."""
        return torch.tensor(self.pages, dtype=torch.long).to(device, non_blocking=True)
