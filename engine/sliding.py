"""The sliding-window layers' state of one sequence, and its fixed-size StateBlock form.

A sliding layer with window ``W`` lets query ``i`` see keys ``i-W+1 … i``, so continuing a sequence at
position ``h`` needs each sliding layer's keys and values of the ``W-1`` positions before ``h``. A StateBlock
for ``prefix[:h]`` (``h`` a multiple of :data:`STATE_INTERVAL`) holds, for every sliding layer, the keys and
values of the **W + 6 positions** ``h-W-6 … h-1``:

- the last ``W`` positions ``h-W … h-1``: the window of the prompt's last query (a superset of the ``W-1``
  keys position ``h`` needs);
- the 6 positions before them, ``h-W-6 … h-W-1``: the speculative margin. They make the state exact for
  resuming anywhere in ``h-6 … h``, i.e. after rolling back up to 6 speculative (draft) positions.

Bytes: ``[sliding layer s][K=0 | V=1][position p = h-W-6 … h-1][kv head][head dim]`` in ``kv_dtype``;
positions before 0 (``h < W+6``) are zeros and never read. Size: ``n_sliding × (W+6) × bytes_per_token``
with ``bytes_per_token = 2 × kv_heads × head_dim × itemsize``.
"""

from __future__ import annotations

import torch

from kvtier.engine.config import ModelConfig

STATE_INTERVAL = 128  # StateBlocks exist only at multiples of this position
SPECULATIVE_POSITIONS = 6


class SlidingState:
    """Per sliding layer, the keys and values of positions ``start … end-1`` of one sequence.

    During a forward each sliding layer appends its chunk (:meth:`extend`); :meth:`trim` then drops what
    no later query can see, keeping ``W + 6`` positions so that StateBlocks can be cut from it.
    """

    def __init__(self, config: ModelConfig, start: int = 0, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        self.window = config.sliding_window or 0
        self.keep = self.window + SPECULATIVE_POSITIONS
        self.slot = {layer: s for s, layer in enumerate(config.sliding_layers)}
        empty = torch.zeros(0, config.num_kv_heads, config.head_dim, dtype=dtype, device=device)
        self.k = [empty] * len(self.slot)
        self.v = [empty] * len(self.slot)
        self.start = start

    @property
    def end(self) -> int:
        return self.start + (self.k[0].shape[0] if self.k else 0)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append a chunk of ``layer``; returns all its keys, values and their positions."""
        s = self.slot[layer]
        self.k[s] = torch.cat((self.k[s], k))
        self.v[s] = torch.cat((self.v[s], v))
        positions = torch.arange(self.start, self.start + self.k[s].shape[0], device=k.device)
        return self.k[s], self.v[s], positions

    def trim(self) -> None:
        drop = max(0, self.end - self.start - self.keep)
        if drop:
            self.k = [k[drop:] for k in self.k]
            self.v = [v[drop:] for v in self.v]
            self.start += drop

    def state_block(self, h: int) -> torch.Tensor:
        """The StateBlock of ``prefix[:h]`` as flat bytes; needs positions ``max(0, h-W-6) … h-1`` held."""
        first = h - self.keep
        if max(first, 0) < self.start or h > self.end:
            raise ValueError(f"state at {h} needs positions {max(first, 0)}…{h - 1}, held {self.start}…{self.end - 1}")
        lo, hi = max(first, 0) - self.start, h - self.start
        kv = torch.stack([torch.stack((k[lo:hi], v[lo:hi])) for k, v in zip(self.k, self.v, strict=True)])
        if first < 0:
            kv = torch.nn.functional.pad(kv, (0, 0, 0, 0, -first, 0))
        return kv.contiguous().view(-1).view(torch.uint8)

    @classmethod
    def from_state_block(
        cls, config: ModelConfig, data: torch.Tensor, h: int, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> SlidingState:
        """The state at ``h`` back from :meth:`state_block`'s bytes (a uint8 tensor)."""
        state = cls(config, max(0, h - config.sliding_window - SPECULATIVE_POSITIONS), dtype, device)
        kv = data.to(device).view(dtype).view(len(state.slot), 2, state.keep, config.num_kv_heads, config.head_dim)
        kv = kv[:, :, state.keep - (h - state.start) :]
        state.k = [kv[s, 0].clone() for s in range(len(state.slot))]
        state.v = [kv[s, 1].clone() for s in range(len(state.slot))]
        return state


def state_block_bytes(config: ModelConfig, itemsize: int) -> int:
    """``n_sliding × (W + 6) × bytes_per_token``."""
    per_token = 2 * config.num_kv_heads * config.head_dim * itemsize
    return len(config.sliding_layers) * ((config.sliding_window or 0) + SPECULATIVE_POSITIONS) * per_token
