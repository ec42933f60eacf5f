"""DeepSeek-V4 as a model family (``family.py`` says what a family declares): its block KV is the compressed
branches, its StateBlock the windows and the compressors' accumulators.

A stored block (a page) of ``block_tokens`` positions, contiguous, in the compute dtype:

    for each compressor in layer order (a CSA layer's compressor, then its indexer; an HCA layer's compressor):
        [entry e = 0 … block_tokens / rate − 1][width]

i.e. per CSA layer ``block_tokens/4`` entries of ``head_dim`` and as many indexer keys of ``index_head_dim``, per
HCA layer ``block_tokens/128`` entries of ``head_dim``; nothing of the window. ``block_tokens`` is a multiple of
``lcm(128, csa_rate, hca_rate)`` (default: that), so every block holds whole entries and a StateBlock position
(a multiple of 128) that is a block boundary has no compressor mid-window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kvtier.engine.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from kvtier.engine.deepseek_v4.model import INDEXER, Batch, DeepseekV4
from kvtier.engine.deepseek_v4.state import DenseEntries, Name, V4State, compressors, state_block_bytes
from kvtier.engine.deepseek_v4.weights import checkpoint_names, load_tensors
from kvtier.engine.formats import Part
from kvtier.engine.paged_cache import PagePool
from kvtier.engine.sliding import SPECULATIVE_POSITIONS, STATE_INTERVAL


class V4Pages(PagePool):
    """Pages of compressed entries (see the module docstring); ``view(name)`` is one compressor's part of every
    page as ``[pages, entries per block, width]``."""

    def __init__(
        self, config: V4Config, num_pages: int, block_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.parts: dict[Name, tuple[int, int, int]] = {}  # offset, entries per block, width
        offset = 0
        for c in compressors(config):
            per = block_tokens // c.rate
            self.parts[(c.layer, c.name)] = (offset, per, c.width)
            offset += per * c.width
        super().__init__(num_pages, (offset,), block_tokens, dtype, device)

    def view(self, name: Name) -> torch.Tensor:
        offset, per, width = self.parts[name]
        return self.pages[:, offset : offset + per * width].view(self.pages.shape[0], per, width)


class PagedEntries:
    """One sequence's compressed entries in its pages (``table``: its page table on the device, set per chunk)."""

    def __init__(self, cache: V4Pages) -> None:
        self.cache = cache
        self.table = torch.zeros(0, dtype=torch.long)

    def append(self, name: Name, first: int, new: torch.Tensor) -> torch.Tensor:
        view = self.cache.view(name)
        per = view.shape[1]
        if new.shape[0]:
            index = torch.arange(first, first + new.shape[0], device=view.device)
            view[self.table[index // per], index % per] = new
        n = first + new.shape[0]
        return view[self.table[: -(-n // per)]].flatten(0, 1)[:n]


class DeepseekV4Family:
    name = "deepseek_v4"
    model_types = ("deepseek_v4",)
    # as transformers keeps them (_keep_in_fp32_modules_strict): hyper-connections, sinks, position biases,
    # the router's correction bias and every norm
    keep_float32 = ("hc", "sinks", "position_bias", "e_score_correction_bias", "norm")

    def parse(self, raw: dict[str, Any], where: str) -> V4Config:
        return V4Config.from_dict(raw, where)

    def build(self, config: V4Config) -> nn.Module:
        return DeepseekV4(config)

    def load_weights(
        self, config: V4Config, names: Iterable[str], get: Callable[[str], torch.Tensor], where: str
    ) -> dict[str, torch.Tensor]:
        return load_tensors(names, get, config.n_routed_experts, where)

    def saved_weights(self, config: V4Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return checkpoint_names(state)

    def granule(self, config: V4Config) -> int:
        rates = [config.rate(layer) for layer in range(config.num_layers)]
        return math.lcm(STATE_INTERVAL, *[r for r in rates if r])

    def block_tokens(self, config: V4Config, asked: int | None) -> int:
        granule = self.granule(config)
        if asked is None:
            return granule
        if asked < 1 or asked % granule:
            raise ValueError(
                f"block_tokens must be a multiple of {granule} for this DeepSeek-V4 checkpoint "
                f"(128 and its compress rates), got {asked}"
            )
        return asked

    def block_layout(self, config: V4Config, block_tokens: int) -> str:
        kinds = "".join({SLIDING: "S", CSA: "C", HCA: "H"}[t] for t in config.layer_types)
        c, d, i = config.csa_rate, config.head_dim, config.index_head_dim
        return f"kvtier.deepseek_v4.v1[T{block_tokens}][{kinds}][C{c}xD{d}+I{i}][H{config.hca_rate}xD{d}]"

    def pages(
        self, config: V4Config, num_pages: int, block_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> V4Pages:
        return V4Pages(config, num_pages, block_tokens, dtype, device)

    def state_bytes(self, config: V4Config, dtype: torch.dtype) -> int:
        return state_block_bytes(config, dtype)

    def kv_parts(self, config: V4Config, block_tokens: int, dtype: torch.dtype) -> tuple[list[Part], list[Part]]:
        """A block: each compressor's entries (``main``; an indexer's keys ``index``); a StateBlock: every layer's
        window rows (``window``), then the compressors' partial windows and overlap state (``state``, opaque: gates
        are float32). Entries, keys and window rows carry RoPE in their last ``rope.dim`` channels."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        rope = config.rope_compress.dim
        block = [
            Part("index" if c.name == INDEXER else "main", block_tokens // c.rate, c.width, itemsize, rope)
            for c in compressors(config)
        ]
        rows = config.num_layers * (config.sliding_window + SPECULATIVE_POSITIONS)
        window = Part("window", rows, config.head_dim, itemsize, config.rope_main.dim)
        return block, [window, Part("state", 1, state_block_bytes(config, dtype) - window.nbytes, 1)]

    def new_state(self, config: V4Config, cache: V4Pages, seq: Any, start: int) -> V4State:
        return V4State(config, PagedEntries(cache), start, cache.pages.dtype, cache.pages.device)

    def restore(self, config: V4Config, cache: V4Pages, seq: Any, data: torch.Tensor, h: int) -> V4State:
        return V4State.from_state_block(config, PagedEntries(cache), data, h, cache.pages.dtype, cache.pages.device)

    def context(
        self,
        model: nn.Module,
        cache: V4Pages,
        seq: Any,
        table: torch.Tensor,
        span: tuple[int, int],
        write: bool,
        marks: list[int],
    ) -> V4State:
        state: V4State = seq.state
        assert isinstance(state.store, PagedEntries)
        state.store.table = table
        prompt = seq.prefill if span[0] < seq.prefill else 0
        state.begin(span, prompt, write, marks)
        return state

    def batch(self, model: nn.Module, cache: V4Pages, parts: list[Any]) -> Batch:
        return Batch(parts)

    def reference(self, model: nn.Module, total: int) -> Callable[[torch.Tensor], V4State]:
        assert isinstance(model, DeepseekV4)
        param = next(model.parameters())
        state = V4State(model.config, DenseEntries(), 0, param.dtype, param.device)

        def chunk(positions: torch.Tensor) -> V4State:
            state.trim()
            state.begin((int(positions[0]), int(positions[-1]) + 1), total, True, [])
            return state

        return chunk

    def reference_chunk(self, device: torch.device, asked: int) -> int:
        """On the CPU the whole sequence at once, as transformers computes it: every matmul then has transformers'
        shapes and rounds as it does, so an indexer tie (equal scores of different entries) falls the same way."""
        return asked if device.type != "cpu" else 1 << 62

    def hit_margin(self, config: V4Config) -> int:
        return 1  # a StateBlock at h resumes exactly at h: only the last prompt token must be computed

    def replay_tokens(self, config: V4Config) -> int:
        return config.sliding_window


DEEPSEEK_V4 = DeepseekV4Family()
