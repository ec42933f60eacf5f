"""The dense families (Llama / Qwen2 / Mistral): global layers keep block KV in pages, sliding layers their window
in the sequence's :class:`~kvtier.engine.sliding.SlidingState` (a StateBlock's contents).

``family.py`` has what a family declares; this module is that declaration for ``config.ModelConfig`` checkpoints.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kvtier.engine import paged_attention
from kvtier.engine.config import FAMILIES, ModelConfig
from kvtier.engine.formats import Part
from kvtier.engine.model import CausalLM, attention, causal_attention, padded_attention
from kvtier.engine.paged_attention import paged_decode
from kvtier.engine.paged_cache import PagedKVCache, block_layout
from kvtier.engine.sliding import SPECULATIVE_POSITIONS, SlidingState, state_block_bytes

DEFAULT_BLOCK_TOKENS = 64


class PagedContext:
    """The :class:`~kvtier.engine.model.KVContext` of one chunk: global layers write their keys and values to
    the sequence's pages (unless ``write_global`` is off: bounded replay reads the reused KV as is) and attend
    to every position up to the query; sliding layers attend within their window of the sliding state."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        state: SlidingState,
        table: torch.Tensor,
        span: tuple[int, int],
        write_global: bool,
    ):
        self.windows = model.windows()
        self.cache, self.state, self.table, self.write_global = cache, state, table, write_global
        self.end = span[1]  # a Python int: reading a device tensor's value would wait for the device
        self.positions = torch.arange(*span, device=cache.pages.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window = self.windows[layer]
        if window is not None:
            keys, values, k_pos = self.state.extend(layer, k, v)
            return attention(q, keys, values, self.positions, k_pos, window)
        if self.write_global:
            self.cache.write(layer, self.table, self.positions, k, v)
        keys, values = self.cache.read(layer, self.table, self.end)
        return causal_attention(q, keys, values)


class BatchContext:
    """The :class:`~kvtier.engine.model.KVContext` of several sequences' chunks in one forward (rows in the order of
    ``parts``, each a :class:`PagedContext`). The parts of one query (decode steps) attend together: a global layer
    reads their pages in place on a GPU (``paged_attention``), elsewhere gathers them whole (one copy of each page's
    slice of the layer) into one padded batch; a sliding layer pads their windows (each extended in its own state)
    into one; keys past a sequence's length, or outside its window, are masked. Longer chunks attend one by one.
    Every part's new keys and values go to the pages with one scatter."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, parts: list[PagedContext]) -> None:
        assert all(p.write_global for p in parts), "bounded replay runs alone"
        self.windows = model.windows()
        self.cache, self.parts = cache, parts
        self.positions = torch.cat([p.positions for p in parts])
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.positions.shape[0])
        self.rows = list(itertools.pairwise(bounds))
        device, block = cache.pages.device, cache.block_tokens
        self.write_page = torch.cat([p.table[p.positions // block] for p in parts])
        self.write_offset = self.positions % block
        self.single = [i for i, (lo, hi) in enumerate(self.rows) if hi - lo == 1]
        self.rest = [i for i, (lo, hi) in enumerate(self.rows) if hi - lo > 1]
        self.decode_rows = torch.tensor([self.rows[i][0] for i in self.single], dtype=torch.long, device=device)
        if self.single:
            tables = [parts[i].table[: -(-parts[i].end // block)] for i in self.single]
            self.gather_pages = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)  # [B, P] (0: padding)
            ends = self.lengths = torch.tensor([parts[i].end for i in self.single], device=device)
            self.visible = torch.arange(self.gather_pages.shape[1] * block, device=device)[None, :] < ends[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        window = self.windows[layer]
        if window is not None:
            if self.single:
                out[self.decode_rows] = self._windows(layer, q, k, v, window)
            for i in self.rest:
                a, b = self.rows[i]
                out[a:b] = self.parts[i].attend(layer, q[a:b], k[a:b], v[a:b])
            return out
        g = self.cache.slot[layer]
        self.cache.pages[self.write_page, g, 0, self.write_offset] = k
        self.cache.pages[self.write_page, g, 1, self.write_offset] = v
        if self.single and q.is_cuda and paged_attention.available:  # read in place
            layer_kv = self.cache.pages[:, g]
            out[self.decode_rows] = paged_decode(q[self.decode_rows], layer_kv[:, 0], layer_kv[:, 1],
                                                 self.gather_pages, self.lengths)  # fmt: skip
        elif self.single:
            b, pages = self.gather_pages.shape[0], self.gather_pages.view(-1)
            # K and V gathered apart: each page's slice lands contiguous, so [B, P·T, kvh, d] is a view
            gathered = (self.cache.pages[pages, g, i].view(b, -1, *k.shape[1:]) for i in (0, 1))
            keys, values = (x.transpose(1, 2) for x in gathered)
            out[self.decode_rows] = padded_attention(q[self.decode_rows], keys, values, self.visible)
        for i in self.rest:
            a, b = self.rows[i]
            keys, values = self.cache.read(layer, self.parts[i].table, self.parts[i].end)
            out[a:b] = causal_attention(q[a:b], keys, values)
        return out

    def _windows(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        """The decode parts' attention in sliding ``layer``: each window extended in its own state, then padded
        into one batch."""
        held = [self.parts[i].state.extend(layer, k[a:b], v[a:b]) for i in self.single for a, b in [self.rows[i]]]
        pad = torch.nn.utils.rnn.pad_sequence
        keys = pad([h[0] for h in held], batch_first=True).transpose(1, 2)
        values = pad([h[1] for h in held], batch_first=True).transpose(1, 2)
        k_pos = pad([h[2] for h in held], batch_first=True, padding_value=-(1 << 62))
        q_pos = self.positions[self.decode_rows][:, None]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return padded_attention(q[self.decode_rows], keys, values, visible)


class DenseKV:
    """Every layer's keys and values of one sequence, contiguous, grown chunk by chunk: the reference forward's
    context (set ``positions`` before each chunk)."""

    def __init__(self, model: CausalLM) -> None:
        self.windows = model.windows()
        self.k: list[torch.Tensor | None] = [None] * len(self.windows)
        self.v: list[torch.Tensor | None] = [None] * len(self.windows)
        self.positions = torch.empty(0, dtype=torch.long)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        old_k, old_v = self.k[layer], self.v[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat((old_k, k)), torch.cat((old_v, v))
        self.k[layer], self.v[layer] = k, v
        k_pos = torch.arange(k.shape[0], device=q.device)
        return attention(q, k, v, self.positions, k_pos, self.windows[layer])


class DenseFamily:
    name = "dense"
    model_types = FAMILIES
    keep_float32: tuple[str, ...] = ()

    def parse(self, raw: dict[str, Any], where: str) -> ModelConfig:
        return ModelConfig.from_dict(raw, where)

    def build(self, config: ModelConfig) -> nn.Module:
        return CausalLM(config)

    def load_weights(
        self, config: ModelConfig, names: Iterable[str], get: Callable[[str], torch.Tensor], where: str
    ) -> dict[str, torch.Tensor]:
        return {name: get(name) for name in names}

    def saved_weights(self, config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def block_tokens(self, config: ModelConfig, asked: int | None) -> int:
        if asked is not None and asked < 1:
            raise ValueError(f"block_tokens must be positive, got {asked}")
        return DEFAULT_BLOCK_TOKENS if asked is None else asked

    def block_layout(self, config: ModelConfig, block_tokens: int) -> str:
        return block_layout(config, block_tokens)

    def pages(
        self, config: ModelConfig, num_pages: int, block_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> PagedKVCache:
        return PagedKVCache(config, num_pages, block_tokens, dtype, device)

    def state_bytes(self, config: ModelConfig, dtype: torch.dtype) -> int:
        return state_block_bytes(config, torch.empty(0, dtype=dtype).element_size())

    def kv_parts(self, config: ModelConfig, block_tokens: int, dtype: torch.dtype) -> tuple[list[Part], list[Part]]:
        """A block: the global layers' K and V, ``main``; a StateBlock: the sliding layers' K and V, ``window``; rows
        of ``kv_heads × head_dim`` values (RoPE covers every channel of K: no channel is apart)."""
        itemsize, width = torch.empty(0, dtype=dtype).element_size(), config.num_kv_heads * config.head_dim
        block = [Part("main", len(config.global_layers) * 2 * block_tokens, width, itemsize)]
        keep = (config.sliding_window or 0) + SPECULATIVE_POSITIONS
        windows = len(config.sliding_layers) * 2 * keep
        return block, [Part("window", windows, width, itemsize)] if windows else []

    def new_state(self, config: ModelConfig, cache: PagedKVCache, seq: Any, start: int) -> SlidingState:
        return SlidingState(config, start, cache.pages.dtype, cache.pages.device)

    def restore(self, config: ModelConfig, cache: PagedKVCache, seq: Any, data: torch.Tensor, h: int) -> SlidingState:
        return SlidingState.from_state_block(config, data, h, cache.pages.dtype, cache.pages.device)

    def context(
        self,
        model: nn.Module,
        cache: PagedKVCache,
        seq: Any,
        table: torch.Tensor,
        span: tuple[int, int],
        write: bool,
        marks: list[int],
    ) -> PagedContext:
        assert isinstance(model, CausalLM)
        return PagedContext(model, cache, seq.state, table, span, write)

    def batch(self, model: nn.Module, cache: PagedKVCache, parts: list[Any]) -> BatchContext:
        assert isinstance(model, CausalLM)
        return BatchContext(model, cache, parts)

    def reference(self, model: nn.Module, total: int) -> Callable[[torch.Tensor], DenseKV]:
        assert isinstance(model, CausalLM)
        kv = DenseKV(model)

        def chunk(positions: torch.Tensor) -> DenseKV:
            kv.positions = positions
            return kv

        return chunk

    def reference_chunk(self, device: torch.device, asked: int) -> int:
        return asked

    def hit_margin(self, config: ModelConfig) -> int:
        return (config.sliding_window + SPECULATIVE_POSITIONS) if config.sliding_layers else 1

    def replay_tokens(self, config: ModelConfig) -> int:
        return config.sliding_window if config.sliding_layers else 0


DENSE = DenseFamily()
