"""One sequence's DeepSeek-V4 attention state, and its fixed-size StateBlock form.

What crosses a chunk boundary, per layer (names as in transformers' V4 cache layers):

- the window, K = V rows (every layer): the last ``W + 6`` positions; here, and in a StateBlock;
- compressed entries, ``compressed_kv`` (CSA: compressor and indexer; HCA: compressor): one per ``rate`` positions;
  block KV (an :class:`EntryStore`);
- partial windows, ``buffer_kv`` / ``buffer_gate`` (every compressor): ``position mod rate`` rows; here, and in a
  StateBlock;
- overlap state, ``overlap_kv`` / ``overlap_gate`` (CSA compressor and indexer): ``rate`` rows, the last window's
  first series; here, and in a StateBlock.

A StateBlock for ``prefix[:h]`` (``h`` a multiple of 128) is those three rows of state at ``h``, laid out as
``[window: layer][position h−W−6 … h−1][head_dim]`` then, per compressor in layer order (compressor before
indexer), ``[partial kv][partial gate]`` (``rate − gcd(rate, 128)`` rows reserved, ``h mod rate`` used) and, for
CSA, ``[overlap kv][overlap gate]`` (``rate`` rows; gates in float32, as the model adds its float32 position bias
before keeping them). Window positions before 0 are zeros and never read. Everything else is derived from ``h``:
entry counts (``h // rate``), whether an overlap exists yet (``h ≥ rate``). The 6 window rows before the last
``W`` follow the seed's layout (room to roll back draft positions of the window); the compressors' state is the
state at ``h``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.engine.deepseek_v4.config import CSA, V4Config
from kvtier.engine.deepseek_v4.model import COMPRESSOR, INDEXER
from kvtier.engine.sliding import SPECULATIVE_POSITIONS, STATE_INTERVAL

Name = tuple[int, str]


@dataclass(frozen=True)
class CompressorShape:
    """One compressor of the model: its layer and name, rate, entry width and projected width (``series × width``)."""

    layer: int
    name: str
    rate: int
    width: int
    overlapping: bool

    @property
    def projected(self) -> int:
        return (2 if self.overlapping else 1) * self.width

    @property
    def partial_rows(self) -> int:
        """Rows a StateBlock reserves for the partial window: the most ``h mod rate`` can be at ``h`` a multiple
        of 128."""
        return self.rate - math.gcd(self.rate, STATE_INTERVAL)


def compressors(config: V4Config) -> list[CompressorShape]:
    """Every compressor, in layer order (a CSA layer's compressor before its indexer)."""
    out = []
    for layer in range(config.num_layers):
        rate = config.rate(layer)
        if not rate:
            continue
        csa = config.layer_types[layer] == CSA
        out.append(CompressorShape(layer, COMPRESSOR, rate, config.head_dim, csa))
        if csa:
            out.append(CompressorShape(layer, INDEXER, rate, config.index_head_dim, True))
    return out


class EntryStore(Protocol):
    """Where a sequence's compressed entries live (the engine's pages, or contiguous tensors)."""

    def append(self, name: Name, first: int, new: torch.Tensor) -> torch.Tensor:
        """Keep entries ``first … first+len(new)-1`` of ``name``; return entries ``0 … first+len(new)-1``."""
        ...


class DenseEntries:
    """Entries in growing contiguous tensors: the reference forward's store."""

    def __init__(self) -> None:
        self.held: dict[Name, torch.Tensor] = {}

    def append(self, name: Name, first: int, new: torch.Tensor) -> torch.Tensor:
        old = self.held.get(name)
        assert (0 if old is None else old.shape[0]) == first, "entries are appended in order"
        self.held[name] = new if old is None else torch.cat((old, new))
        return self.held[name]


class V4State:
    """The state of one sequence from position ``start`` of the window on (see the module docstring), and the
    :class:`~kvtier.engine.deepseek_v4.model.V4KV` of its chunks: :meth:`begin` before a forward, :meth:`trim`
    after it.

    A StateBlock can be cut at any position a chunk was told to mark (``begin``'s ``marks``): the compressors'
    partial windows and overlap state are snapshotted as the chunk passes each mark, the window rows are cut from
    the rows held. With ``write`` off (bounded replay) compressors pool as usual but the entries they make are not
    kept (the store's exact ones are returned instead); a state that starts mid-window (replay's first position)
    pools from the next window boundary on."""

    def __init__(
        self, config: V4Config, entries: EntryStore, start: int = 0, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> None:
        self.config, self.store, self.dtype, self.device = config, entries, dtype, torch.device(device)
        self.keep = config.sliding_window + SPECULATIVE_POSITIONS
        self.shapes = {(c.layer, c.name): c for c in compressors(config)}
        self.start = start
        empty = torch.zeros(0, config.head_dim, dtype=dtype, device=self.device)
        self.rows = [empty] * config.num_layers
        self.partial_kv: dict[Name, torch.Tensor] = {}
        self.partial_gate: dict[Name, torch.Tensor] = {}
        self.overlaps: dict[Name, tuple[torch.Tensor, torch.Tensor]] = {}
        self.counts = {name: -(-start // c.rate) for name, c in self.shapes.items()}
        self.skip = {name: -start % c.rate for name, c in self.shapes.items()}  # rows before a window boundary
        for name, c in self.shapes.items():
            self.partial_kv[name] = torch.zeros(0, c.projected, dtype=dtype, device=self.device)
            self.partial_gate[name] = torch.zeros(0, c.projected, dtype=dtype, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.prompt_tokens = 0
        self.write = True
        self.marks: list[int] = []
        self.snapshots: dict[int, dict[Name, list[torch.Tensor | None]]] = {}

    @property
    def end(self) -> int:
        return self.start + self.rows[0].shape[0] if self.rows else self.start

    def begin(self, span: tuple[int, int], prompt_tokens: int, write: bool, marks: list[int]) -> None:
        """Ready the state for the chunk of positions ``span`` (``span[0] == end``): queries of a prompt of
        ``prompt_tokens`` tokens (0 for a decode step), writing entries or not, snapshotting at ``marks``."""
        assert span[0] == self.end, f"a chunk from {span[0]} on a state at {self.end}"
        self.positions = torch.arange(*span, device=self.device)
        self.prompt_tokens, self.write = prompt_tokens, write
        self.marks = [m for m in marks if span[0] < m <= span[1]]
        for m in self.marks:  # (an overlap not replaced by a window that ends by m is the one held now)
            self.snapshots[m] = {name: [None, None, *self.overlaps.get(name, (None, None))] for name in self.shapes}

    # -- V4KV ------------------------------------------------------------------------------------------

    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.rows[layer] = torch.cat((self.rows[layer], kv))
        return self.rows[layer], self.start

    def pool(
        self, layer: int, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        key = (layer, name)
        rate, skip = self.shapes[key].rate, self.skip[key]
        if skip:
            self.skip[key] = max(0, skip - kv.shape[0])
            kv, gate = kv[skip:], gate[skip:]
        kv = torch.cat((self.partial_kv[key], kv))
        gate = torch.cat((self.partial_gate[key], gate))
        first = self.counts[key] * rate
        for m in self.marks:
            if first <= m <= first + kv.shape[0]:
                lo = m - m % rate - first
                snap = self.snapshots[m][key]
                snap[0], snap[1] = kv[lo : m - first].clone(), gate[lo : m - first].clone()
        usable = kv.shape[0] // rate * rate
        self.partial_kv[key], self.partial_gate[key] = kv[usable:], gate[usable:]
        return kv[:usable], gate[:usable], first

    def overlap(
        self, layer: int, name: str, first: int, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (layer, name)
        rate = self.shapes[key].rate
        prior = self.overlaps.get(key)
        for m in self.marks:
            j = min((m - first) // rate, kv.shape[0]) - 1  # the last window that ends at or before m
            if j >= 0:
                self.snapshots[m][key][2:] = [kv[j].clone(), gate[j].clone()]
        self.overlaps[key] = (kv[-1].clone(), gate[-1].clone())
        return prior

    def entries(self, layer: int, name: str, new: torch.Tensor) -> torch.Tensor:
        key = (layer, name)
        first = self.counts[key]
        self.counts[key] = first + new.shape[0]
        if self.write:
            return self.store.append(key, first, new)
        return self.store.append(key, first, new[:0])[: first + new.shape[0]]

    def topk_row(self, rate: int) -> int:
        return self.prompt_tokens // rate

    # -- between chunks --------------------------------------------------------------------------------

    def trim(self) -> None:
        """Drop window rows no later query can see, keeping ``W + 6`` for StateBlocks; snapshots at marks
        the window has moved past are dropped too."""
        drop = max(0, self.end - self.start - self.keep)
        if drop:
            self.rows = [r[drop:] for r in self.rows]
            self.start += drop
        for m in [m for m in self.snapshots if m < self.end]:
            del self.snapshots[m]

    # -- StateBlocks -----------------------------------------------------------------------------------

    def state_block(self, h: int) -> torch.Tensor:
        """The StateBlock of ``prefix[:h]`` as flat bytes: ``h`` is the state's end, or a mark of its last chunk."""
        first = h - self.keep
        if max(first, 0) < self.start or h > self.end or (h != self.end and h not in self.snapshots):
            raise ValueError(f"no state at {h}: held {self.start}…{self.end - 1}, marks {sorted(self.snapshots)}")
        parts = []
        rows = torch.stack([r[max(first, 0) - self.start : h - self.start] for r in self.rows])
        if first < 0:
            rows = torch.nn.functional.pad(rows, (0, 0, -first, 0))
        parts.append(rows.reshape(-1).view(torch.uint8))
        for (dtype, shape), tensor in zip(self._layout(), self._tensors(h), strict=True):
            region = torch.zeros(shape, dtype=dtype, device=self.device)
            region[: tensor.shape[0]] = tensor.to(dtype)
            parts.append(region.reshape(-1).view(torch.uint8))
        return torch.cat(parts)

    @classmethod
    def from_state_block(
        cls, config: V4Config, entries: EntryStore, data: torch.Tensor, h: int, dtype: torch.dtype, device
    ) -> V4State:
        """The state at ``h`` back from :meth:`state_block`'s bytes (a uint8 tensor)."""
        state = cls(config, entries, h, dtype, device)
        state.start = max(0, h - state.keep)
        data = data.to(state.device)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        window = config.num_layers * state.keep * config.head_dim * itemsize
        rows = data[:window].view(dtype).view(config.num_layers, state.keep, config.head_dim)
        rows = rows[:, state.keep - (h - state.start) :]
        state.rows = [rows[i].clone() for i in range(config.num_layers)]
        offset = window
        regions = []
        for region_dtype, shape in state._layout():
            n = math.prod(shape) * torch.empty(0, dtype=region_dtype).element_size()
            regions.append(data[offset : offset + n].view(region_dtype).view(shape))
            offset += n
        state._restore(h, iter(regions))
        return state

    def _layout(self) -> Iterator[tuple[torch.dtype, tuple[int, ...]]]:
        """The regions after the window, in order: (dtype, shape)."""
        for c in self.shapes.values():
            yield self.dtype, (c.partial_rows, c.projected)
            yield self.dtype, (c.partial_rows, c.projected)
            if c.overlapping:
                yield self.dtype, (c.rate, c.width)
                yield torch.float32, (c.rate, c.width)

    def _tensors(self, h: int) -> Iterator[torch.Tensor]:
        """The state at ``h`` region by region (an empty tensor where there is none yet)."""
        snapshot = self.snapshots.get(h)
        for name, c in self.shapes.items():
            if snapshot is not None:
                held = snapshot[name]
            else:
                overlap = self.overlaps.get(name) or (None, None)
                held = [self.partial_kv[name], self.partial_gate[name], *overlap]
            empty = torch.zeros(0, device=self.device)
            yield held[0] if held[0] is not None else empty
            yield held[1] if held[1] is not None else empty
            if c.overlapping:
                yield held[2] if held[2] is not None else empty
                yield held[3] if held[3] is not None else empty

    def _restore(self, h: int, regions: Iterator[torch.Tensor]) -> None:
        for name, c in self.shapes.items():
            used = h % c.rate
            self.partial_kv[name] = next(regions)[:used].clone()
            self.partial_gate[name] = next(regions)[:used].clone()
            self.counts[name], self.skip[name] = h // c.rate, 0
            if c.overlapping:
                kv, gate = next(regions), next(regions)
                if h >= c.rate:
                    self.overlaps[name] = (kv.clone(), gate.clone())


def state_block_bytes(config: V4Config, dtype: torch.dtype) -> int:
    """Bytes of one StateBlock (see the module docstring)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    total = config.num_layers * (config.sliding_window + SPECULATIVE_POSITIONS) * config.head_dim * itemsize
    for c in compressors(config):
        total += 2 * c.partial_rows * c.projected * itemsize
        if c.overlapping:
            total += c.rate * c.width * (itemsize + 4)
    return total
