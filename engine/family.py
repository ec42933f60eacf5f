"""Model families: what each checkpoint's model is, and what its KV is made of. The engine asks the family of a
checkpoint (by ``model_type``) and never branches on the family itself.

A family declares, for a config of its own:

- the model: ``model.CausalLM`` (dense: llama, mistral, qwen2) or ``deepseek_v4.model.DeepseekV4``;
- a stored block (a page) of ``block_tokens`` positions: dense, every global layer's K and V; DeepSeek-V4, per CSA
  layer its compressed entries and indexer keys, per HCA layer its compressed entries;
- a StateBlock: dense, every sliding layer's window (``W + 6`` positions); DeepSeek-V4, every layer's window
  (``W + 6``), the compressors' partial windows and CSA's overlap state;
- the block size: dense, any (default 64); DeepSeek-V4, a multiple of ``lcm(128, compress rates)`` (default that);
- the hit margin (hit ≤ ``L − margin``): dense, ``W + 6`` with sliding layers, else 1; DeepSeek-V4, 1;
- the kinds of tensor in a block and a StateBlock (``kv_parts``, what KV formats apply to; ``formats.py``).

The hit rule itself (``reuse.plan``) and everything that moves blocks and StateBlocks is the same for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from kvtier.engine.config import UnsupportedModelError
from kvtier.engine.deepseek_v4.family import DEEPSEEK_V4
from kvtier.engine.dense_family import DENSE
from kvtier.engine.formats import Part


class SequenceState(Protocol):
    """The part of one sequence's attention state that is not in its pages: what a StateBlock holds."""

    start: int

    @property
    def end(self) -> int: ...

    def trim(self) -> None:
        """Drop what no later position needs (called after each chunk)."""
        ...

    def state_block(self, h: int) -> torch.Tensor:
        """The StateBlock of ``prefix[:h]`` as flat uint8 bytes."""
        ...


class Pages(Protocol):
    """A device's pool of pages, one stored block each (``paged_cache.PagePool``)."""

    pages: torch.Tensor
    block_tokens: int

    @property
    def page_bytes(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def release(self, pages: Iterable[int]) -> None: ...


class Family(Protocol):
    """One model family (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]
    keep_float32: tuple[str, ...]  # parameters whose names hold one of these stay float32 in any compute dtype

    def parse(self, raw: dict[str, Any], where: str) -> Any:
        """The config of a ``config.json`` (raises UnsupportedModelError, one line, for what it cannot run)."""
        ...

    def build(self, config: Any) -> nn.Module:
        """The model (``forward(tokens, positions, kv)`` → hidden [T, H]; ``logits(hidden)``)."""
        ...

    def load_weights(
        self, config: Any, names: Iterable[str], get: Callable[[str], torch.Tensor], where: str
    ) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors under the model's parameter names."""
        ...

    def saved_weights(self, config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's state under the names a checkpoint on disk uses (what ``make_checkpoint`` writes)."""
        ...

    def block_tokens(self, config: Any, asked: int | None) -> int:
        """Tokens per stored block: ``asked`` if this family can take it (else ValueError, one line), or its
        default."""
        ...

    def block_layout(self, config: Any, block_tokens: int) -> str:
        """The stored block layout's name (part of the namespace)."""
        ...

    def pages(self, config: Any, num_pages: int, block_tokens: int, dtype: torch.dtype, device: torch.device) -> Pages:
        """The paged cache."""
        ...

    def state_bytes(self, config: Any, dtype: torch.dtype) -> int:
        """Bytes of a StateBlock (0: this model keeps nothing outside its pages)."""
        ...

    def kv_parts(self, config: Any, block_tokens: int, dtype: torch.dtype) -> tuple[list[Part], list[Part]]:
        """What a block and a StateBlock hold, part by part in their byte order (``formats.Part``: what kind of
        tensor, rows, values a row, trailing RoPE channels): what a KV format applies its codecs to."""
        ...

    def new_state(self, config: Any, cache: Pages, seq: Any, start: int) -> SequenceState:
        """An empty state whose window starts at ``start`` (0, or bounded replay's first position)."""
        ...

    def restore(self, config: Any, cache: Pages, seq: Any, data: torch.Tensor, h: int) -> SequenceState:
        """The state at ``h`` from a StateBlock's bytes."""
        ...

    def context(
        self,
        model: nn.Module,
        cache: Pages,
        seq: Any,
        table: torch.Tensor,
        span: tuple[int, int],
        write: bool,
        marks: list[int],
    ) -> Any:
        """The KV context of one chunk (``span``) of ``seq``; ``write`` off: reused block KV is read, not
        rewritten (bounded replay); ``marks``: positions in the span where a StateBlock will be asked for."""
        ...

    def batch(self, model: nn.Module, cache: Pages, parts: list[Any]) -> Any:
        """The KV context of several sequences' chunks run as one forward: ``parts`` are their :meth:`context`
        objects, the forward's rows theirs in that order (its ``positions`` theirs, concatenated)."""
        ...

    def reference(self, model: nn.Module, total: int) -> Callable[[torch.Tensor], Any]:
        """For a whole forward of ``total`` tokens without cache or store: ``positions`` → the KV context of the
        chunk at those positions (one object carrying the state from chunk to chunk)."""
        ...

    def reference_chunk(self, device: torch.device, asked: int) -> int:
        """Queries per chunk of the reference forward, ``asked`` by its caller."""
        ...

    def hit_margin(self, config: Any) -> int:
        """The hit leaves at least this many prompt tokens to compute."""
        ...

    def replay_tokens(self, config: Any) -> int:
        """Positions of the hit bounded replay recomputes when the StateBlock is missing (0: no StateBlocks)."""
        ...


FAMILIES: dict[str, Family] = {t: f for f in (DENSE, DEEPSEEK_V4) for t in f.model_types}


def family_of(raw: dict[str, Any], where: str) -> Family:
    """The family of a ``config.json``'s contents (UnsupportedModelError, one line, when there is none)."""
    kind = raw.get("model_type")
    found = FAMILIES.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise UnsupportedModelError(
            f"{where}: model_type {kind!r} is not supported; this engine runs {', '.join(FAMILIES)}"
        )
    return found
