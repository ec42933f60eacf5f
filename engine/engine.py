"""The engine: prompts in, greedy tokens out, reusing whatever prefix KV the store holds.

Prefill of one prompt, in order:

1. tokens → block keys (``chain``) → ``match`` → the block hit;
2. the hit rule (``reuse.plan``) picks ``h``, asking the StateBlock pool for ``prefix[:h]``;
3. blocks ``0 … h/block_tokens-1`` are fetched into the sequence's pages (a short fetch re-plans with what
   landed); the sliding state comes from the StateBlock (exact) or from bounded replay;
4. positions ``h … L-1`` are computed; the first token is sampled (``ttft_s`` stops here);
5. unless the sequence was replayed, its new full blocks go to the store (with their tokens) and a
   StateBlock for every multiple of 128 it computed goes to the StateBlock pool.

Decode then extends the same pages and sliding state one token at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtier.engine.checkpoint import load, model_id
from kvtier.engine.dense import forward_logits
from kvtier.engine.fetch import FetcherPages, PageTransfer, StorePages
from kvtier.engine.model import CausalLM
from kvtier.engine.paged_cache import PagedKVCache, block_layout
from kvtier.engine.reuse import Plan, Reuse, plan
from kvtier.engine.runner import Runner
from kvtier.engine.sequence import Sequence
from kvtier.engine.sliding import STATE_INTERVAL, SlidingState, state_block_bytes
from kvtier.engine.stateblocks import LocalStateBlocks, StateBlocks
from kvtier.engine.store import BlockStore
from kvtier.kvstore.keys import Namespace, chain
from kvtier.transfer.fetch_client import FetchClient


class PromptError(ValueError):
    """A prompt the model cannot take (empty, longer than its context, token ids outside its vocabulary)."""


@dataclass
class Result:
    tokens: list[int]  # the new tokens
    hit_tokens: int  # prompt tokens whose KV was reused
    replayed: bool  # the sliding state was rebuilt by bounded replay (approximate)
    ttft_s: float  # prefill start to first token
    first_logits: torch.Tensor  # [vocab], float32: the logits the first token was sampled from
    timings: dict[str, float]  # where ``ttft_s`` went: lookup_fetch_s (match, StateBlock, blocks), replay_s, compute_s


class Engine:
    """A model with a paged cache, optionally a client of a store. Not thread-safe."""

    def __init__(
        self,
        model: CausalLM,
        model_id: str,
        store: BlockStore | None = None,
        state_blocks: StateBlocks | None = None,
        block_tokens: int = 64,
        cache_tokens: int = 1 << 16,
        chunk_tokens: int = 512,
    ) -> None:
        self.model = model
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_tokens = block_tokens
        self.namespace = Namespace(
            model_id, str(self.dtype).removeprefix("torch."), block_tokens, block_layout(self.config, block_tokens)
        )
        self.state_namespace = Namespace(model_id, self.namespace.kv_dtype, STATE_INTERVAL, "swa-state")
        self.cache = PagedKVCache(self.config, -(-cache_tokens // block_tokens), block_tokens, self.dtype, self.device)
        self.runner = Runner(model, self.cache, chunk_tokens)
        self.store: BlockStore | None = None
        self.transfer: PageTransfer | None = None
        if store is not None:
            self.attach_store(store)
        self.state_blocks = state_blocks if state_blocks is not None else LocalStateBlocks()
        self.state_bytes = state_block_bytes(self.config, self.cache.pages.element_size())

    def attach_store(self, store: BlockStore, fetcher: FetchClient | None = None) -> None:
        """Reuse and keep prefix KV in ``store`` (its namespace must be this engine's); blocks move through
        ``fetcher`` (the host's fetcher process) when given, else through the store client directly."""
        if store.namespace != self.namespace:
            raise ValueError("the store's namespace is not this engine's (another model, dtype or layout)")
        self.store = store
        self.transfer = (
            FetcherPages(fetcher, store, self.cache) if fetcher is not None else StorePages(store, self.cache)
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        store: str | Path | None = None,
        *,
        token: str | None = None,
        fetcher: str | Path | None = None,
        state_blocks: StateBlocks | None = None,
        block_tokens: int = 64,
        cache_tokens: int = 1 << 16,
        chunk_tokens: int = 512,
    ) -> Engine:
        """Load the checkpoint at ``path``; ``store``: a cluster file to reuse and keep prefix KV in (as the
        tenant of ``token``, default the cluster's); ``fetcher``: the Unix socket of this host's fetcher, to
        move blocks through its shared-memory pool."""
        model = load(path, device, dtype)
        mid = model_id(path)
        engine = cls(model, mid, None, state_blocks, block_tokens, cache_tokens, chunk_tokens)
        if store is not None:
            blocks = BlockStore.open(store, engine.namespace, token)
            client = FetchClient(fetcher, token or blocks.client.config.token) if fetcher is not None else None
            engine.attach_store(blocks, client)
        return engine

    # -- public API -----------------------------------------------------------------------------------

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of one full forward: no cache, no store."""
        return forward_logits(self.model, self._tensor(tokens))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, reuse: bool = True) -> list[Result]:
        """Greedy continuations, one :class:`Result` per prompt (in order). ``reuse=False`` neither reads
        nor writes the store. Raises PromptError for a prompt the model cannot take (checked for every prompt
        before any work)."""
        for p in prompts:
            self._tensor(p)
        return [self._generate_one(list(p), max_new_tokens, reuse) for p in prompts]

    # -- one request ----------------------------------------------------------------------------------

    def _generate_one(self, prompt: list[int], max_new_tokens: int, reuse: bool) -> Result:
        seq = Sequence(prompt, SlidingState(self.config, 0, self.dtype, self.device))
        try:
            first = self.prefill(seq, reuse)
            token = int(first.argmax())
            budget = min(max_new_tokens, self.config.max_position_embeddings - len(prompt))
            while len(seq.generated) < budget:
                seq.generated.append(token)
                if len(seq.generated) < budget:
                    pos = len(seq.tokens) - 1
                    token = int(self.runner.run(seq, pos, pos + 1).argmax())
            return Result(seq.generated, seq.hit_tokens, seq.replayed, seq.ttft_s, first, seq.timings)
        finally:
            self.cache.release(seq.pages)

    def prefill(self, seq: Sequence, reuse: bool = True) -> torch.Tensor:
        """Fill ``seq``'s cache for its prompt (reusing stored KV when ``reuse``); returns the logits [vocab]
        of its last position. ``seq.ttft_s`` counts up to the first token's logits, before publishing."""
        start = time.perf_counter()
        prompt = seq.prompt
        keys = self.store.keys(prompt) if self.store is not None and reuse else []
        matched = self.store.match(keys) if keys else 0
        h, state = self._reuse(seq, keys, matched)
        fetched = time.perf_counter()
        if state is not None:
            seq.sliding = SlidingState.from_state_block(self.config, state, h, self.dtype, self.device)
        elif h:
            window = self.config.sliding_window
            seq.sliding = SlidingState(self.config, h - window, self.dtype, self.device)
            self.runner.run(seq, h - window, h, write_global=False)
            seq.replayed = True
        seq.hit_tokens = h
        storing = bool(keys) and not seq.replayed
        states: list[tuple[int, torch.Tensor]] = []
        on_state: Callable[[int], None] | None = None
        if storing and self.config.sliding_layers:
            on_state = lambda m: states.append((m, seq.sliding.state_block(m)))  # noqa: E731
        computing = time.perf_counter()
        logits = self.runner.run(seq, h, len(prompt), on_state=on_state)
        seq.ttft_s = time.perf_counter() - start
        seq.timings = {"lookup_fetch_s": fetched - start, "replay_s": computing - fetched}
        seq.timings["compute_s"] = seq.ttft_s - (computing - start)
        if storing:
            self._publish(seq, keys, max(matched, h // self.block_tokens), states)
        return logits

    def _reuse(self, seq: Sequence, keys: list[bytes], matched: int) -> tuple[int, torch.Tensor | None]:
        """Apply the hit rule and fetch what it reuses: ``(h, StateBlock bytes or None)``. A fetch that comes
        up short re-plans with the blocks that landed."""
        if not matched or self.transfer is None:
            return 0, None
        state_keys = chain(self.state_namespace, np.asarray(seq.prompt, dtype=np.uint32), self.store.hash_algo)
        buf = torch.empty(self.state_bytes, dtype=torch.uint8)
        found: dict[int, bool] = {}

        def has_state(h: int) -> bool:
            if h not in found:
                found[h] = self.state_blocks.get_into(state_keys[h // STATE_INTERVAL - 1], memoryview(buf.numpy()))
            return found[h]

        block_hit = matched * self.block_tokens
        while True:
            p: Plan = plan(len(seq.prompt), block_hit, self.block_tokens, self.config.sliding_window, has_state)
            if p.reuse is Reuse.NONE:
                return 0, None
            n = p.hit_tokens // self.block_tokens
            self.runner.ensure_pages(seq, p.hit_tokens)
            landed = self.transfer.fetch(keys[:n], seq.pages[:n], seq.prompt[: n * self.block_tokens])
            if landed == n:
                return p.hit_tokens, (buf if p.reuse is Reuse.EXACT else None)
            block_hit = landed * self.block_tokens

    def _publish(self, seq: Sequence, keys: list[bytes], first: int, states: list[tuple[int, torch.Tensor]]) -> None:
        """New full blocks to the store, StateBlocks to the pool (only for exactly computed sequences)."""
        assert self.transfer is not None
        self.transfer.store_pages(keys[first:], seq.pages[first : len(keys)], seq.prompt)
        if states:
            state_keys = chain(self.state_namespace, np.asarray(seq.prompt, dtype=np.uint32), self.store.hash_algo)
            for m, data in states:
                self.state_blocks.put(state_keys[m // STATE_INTERVAL - 1], memoryview(data.cpu().numpy()))

    def _tensor(self, tokens: list[int]) -> torch.Tensor:
        n, limit, vocab = len(tokens), self.config.max_position_embeddings, self.config.vocab_size
        if n == 0:
            raise PromptError("empty prompt: give at least one token")
        if n > limit:
            raise PromptError(f"prompt of {n} tokens is longer than the model's context of {limit} tokens")
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if int(t.min()) < 0 or int(t.max()) >= vocab:
            raise PromptError(f"token ids must be in 0…{vocab - 1}; got {int(t.min())}…{int(t.max())}")
        return t
