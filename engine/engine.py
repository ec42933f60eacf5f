"""The engine: prompts in, greedy tokens out, reusing whatever prefix KV the store holds.

Prefill of one prompt, in order:

1. tokens → block keys (``chain``) → ``match`` → the block hit;
2. the hit rule (``reuse.plan``) picks ``h``, asking the StateBlock pool for ``prefix[:h]``;
3. blocks ``0 … h/block_tokens-1`` are fetched into the sequence's pages (a short fetch re-plans with what
   landed); the sliding state comes from the StateBlock (exact) or from bounded replay;
4. positions ``h … L-1`` are computed; the first token is sampled (``ttft_s`` stops here);
5. unless the sequence was replayed, its new full blocks go to the store (with their tokens) and a
   StateBlock for every multiple of 128 it computed goes to the StateBlock pool.

Decode then extends the same pages and sliding state one token at a time; when it ends, the blocks it
completed (and StateBlocks at the multiples of 128 it passed) are published the same way, so a next turn
that repeats the answer reuses it too.
"""

from __future__ import annotations

import math
import os
import secrets
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
from kvtier.transfer.conn import parse_addr
from kvtier.transfer.fetch_client import FetchClient
from kvtier.transfer.stateblock import StateBlockHost


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
        # StateBlock keys: a chain over the prompt at the granularity of both StateBlock positions and blocks
        granule = math.gcd(STATE_INTERVAL, block_tokens)
        self.state_namespace = Namespace(model_id, self.namespace.kv_dtype, granule, "swa-state")
        self.handoff = False  # also save a StateBlock at the last block boundary (a P/D prefill worker)
        self.cache = PagedKVCache(self.config, -(-cache_tokens // block_tokens), block_tokens, self.dtype, self.device)
        self.runner = Runner(model, self.cache, chunk_tokens)
        self.store: BlockStore | None = None
        self.transfer: PageTransfer | None = None
        if store is not None:
            self.attach_store(store)
        self.state_blocks = state_blocks if state_blocks is not None else LocalStateBlocks()
        self._state_host: StateBlockHost | None = None
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
        directory: str | None = None,
        host_id: str | None = None,
        state_blocks: StateBlocks | None = None,
        state_pool_bytes: int = 256 << 20,
        block_tokens: int = 64,
        cache_tokens: int = 1 << 16,
        chunk_tokens: int = 512,
    ) -> Engine:
        """Load the checkpoint at ``path``.

        ``store``: a cluster file to reuse and keep prefix KV in (as the tenant of ``token``, default the
        cluster's); ``fetcher``: the Unix socket of this host's fetcher, to move blocks through its
        shared-memory pool; ``directory``: ``HOST:PORT`` of the StateBlock directory, to share StateBlocks
        with other processes and hosts (this engine then serves its own, as ``host_id``, from a pool of
        ``state_pool_bytes``); otherwise ``state_blocks``, or a private in-process pool. ``close`` releases
        what this made.
        """
        model = load(path, device, dtype)
        engine = cls(model, model_id(path), None, state_blocks, block_tokens, cache_tokens, chunk_tokens)
        if store is None:
            if fetcher is not None or directory is not None:
                raise ValueError("fetcher= and directory= need store= (the cluster file)")
            return engine
        address = parse_addr(directory) if directory is not None else None  # bad input: one line, nothing opened
        blocks = BlockStore.open(store, engine.namespace, token)
        config = blocks.client.config
        client = FetchClient(fetcher, token or config.token) if fetcher is not None else None
        engine.attach_store(blocks, client)
        if address is not None and engine.state_bytes:
            host_id = host_id or f"engine-{os.getpid()}"
            engine.state_blocks = engine._state_host = StateBlockHost(
                config,
                shm=f"kvtier-state-{host_id}-{secrets.token_hex(3)}",
                capacity_bytes=state_pool_bytes,
                block_bytes=engine.state_bytes,
                host_id=host_id,
                directory=address,
                token=token,
            )
        return engine

    def close(self) -> None:
        """Close the store and fetcher connections and the StateBlock host this engine made."""
        if self._state_host is not None:
            self._state_host.close()
            self._state_host = None
        if self.store is not None:
            self.store.close()
        if isinstance(self.transfer, FetcherPages):
            self.transfer.client.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API -----------------------------------------------------------------------------------

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of one full forward: no cache, no store."""
        return forward_logits(self.model, self._tensor(tokens))

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, reuse: bool = True, resume: bool = False
    ) -> list[Result]:
        """Greedy continuations, one :class:`Result` per prompt (in order).

        ``reuse=False`` neither reads nor writes the store. ``resume=True`` is the decode worker's mode
        (P/D): the prompt was prefilled elsewhere, so reuse every stored block up to the last block boundary
        (with the prefill worker's StateBlock there), recompute at most the last block, and store nothing.
        Raises PromptError for a prompt the model cannot take (every prompt is checked before any work).
        """
        for p in prompts:
            self._tensor(p)
        return [self._generate_one(list(p), max_new_tokens, reuse, resume) for p in prompts]

    # -- one request ----------------------------------------------------------------------------------

    def _generate_one(self, prompt: list[int], max_new_tokens: int, reuse: bool, resume: bool) -> Result:
        seq = Sequence(prompt, SlidingState(self.config, 0, self.dtype, self.device))
        try:
            first = self.prefill(seq, reuse, resume)
            token = int(first.argmax())
            budget = min(max_new_tokens, self.config.max_position_embeddings - len(prompt))
            states: dict[int, torch.Tensor] = {}
            save = self._saver(seq, states) if seq.publishing and self.config.sliding_layers else None
            while len(seq.generated) < budget:
                seq.generated.append(token)
                if len(seq.generated) < budget:
                    pos = len(seq.tokens) - 1
                    at = [pos + 1] if (pos + 1) % STATE_INTERVAL == 0 else []
                    token = int(self.runner.run(seq, pos, pos + 1, state_at=at, on_state=save).argmax())
            if seq.publishing and len(seq.generated) > 1:  # the blocks decode completed (the last token has no KV yet)
                computed = seq.tokens[:-1]
                assert self.store is not None
                keys = self.store.keys(computed)
                self._publish(seq, computed, keys, len(prompt) // self.block_tokens, states)
            return Result(seq.generated, seq.hit_tokens, seq.replayed, seq.ttft_s, first, seq.timings)
        finally:
            self.cache.release(seq.pages)

    def prefill(self, seq: Sequence, reuse: bool = True, resume: bool = False) -> torch.Tensor:
        """Fill ``seq``'s cache for its prompt (reusing stored KV when ``reuse``); returns the logits [vocab]
        of its last position. ``seq.ttft_s`` counts up to the first token's logits, before publishing."""
        start = time.perf_counter()
        prompt = seq.prompt
        keys = self.store.keys(prompt) if self.store is not None and reuse else []
        matched = self.store.match(keys) if keys else 0
        h, state = self._reuse(seq, keys, matched, resume)
        fetched = self._clock()
        if state is not None:
            seq.sliding = SlidingState.from_state_block(self.config, state, h, self.dtype, self.device)
        elif h and self.config.sliding_layers:  # block KV without its StateBlock: bounded replay
            first = max(0, h - self.config.sliding_window)  # the last min(W, h) tokens of the hit
            seq.sliding = SlidingState(self.config, first, self.dtype, self.device)
            self.runner.run(seq, first, h, write_global=False)
            seq.replayed = True
        seq.hit_tokens = h
        seq.publishing = bool(keys) and not seq.replayed and not resume
        states: dict[int, torch.Tensor] = {}
        state_at = self._state_positions(h, len(prompt)) if seq.publishing and self.config.sliding_layers else []
        computing = self._clock()
        logits = self.runner.run(seq, h, len(prompt), state_at=state_at, on_state=self._saver(seq, states))
        seq.ttft_s = self._clock() - start
        seq.timings = {"lookup_fetch_s": fetched - start, "replay_s": computing - fetched}
        seq.timings["compute_s"] = seq.ttft_s - (computing - start)
        if seq.publishing:
            self._publish(seq, prompt, keys, max(matched, h // self.block_tokens), states)
        return logits

    def _clock(self) -> float:
        """``time.perf_counter()`` once the device has done the work queued so far (GPU work is asynchronous)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @staticmethod
    def _saver(seq: Sequence, states: dict[int, torch.Tensor]) -> Callable[[int], None]:
        """``on_state`` for the runner: keep the StateBlock of ``seq`` at each position it is called with."""
        return lambda m: states.update({m: seq.sliding.state_block(m)})

    def _state_positions(self, h: int, length: int) -> list[int]:
        """Where this prefill saves StateBlocks: every multiple of 128 it computes, and with ``handoff`` the
        last block boundary before the final token (where a decode worker resumes)."""
        at = list(range((h // STATE_INTERVAL + 1) * STATE_INTERVAL, length + 1, STATE_INTERVAL))
        boundary = (length - 1) // self.block_tokens * self.block_tokens
        if self.handoff and boundary > h:
            at.append(boundary)
        return at

    def _state_key(self, state_keys: list[bytes], m: int) -> bytes:
        return state_keys[m // self.state_namespace.block_tokens - 1]

    def _reuse(self, seq: Sequence, keys: list[bytes], matched: int, resume: bool) -> tuple[int, torch.Tensor | None]:
        """Apply the hit rule and fetch what it reuses: ``(h, StateBlock bytes or None)``. A fetch that comes
        up short re-plans with the blocks that landed."""
        if not matched or self.transfer is None or self.store is None:
            return 0, None
        state_keys = chain(self.state_namespace, np.asarray(seq.prompt, dtype=np.uint32), self.store.hash_algo)
        buf = torch.empty(self.state_bytes, dtype=torch.uint8)
        found: dict[int, bool] = {}

        def has_state(h: int) -> bool:
            if h not in found:  # a lookup fills ``buf``: the last one asked is the one a plan uses
                found.clear()
                found[h] = self.state_blocks.get_into(self._state_key(state_keys, h), memoryview(buf.numpy()))
            return found[h]

        block_hit = matched * self.block_tokens
        while True:
            p: Plan = plan(len(seq.prompt), block_hit, self.block_tokens, self.config.sliding_window, has_state, resume)
            if p.reuse is Reuse.NONE:
                return 0, None
            n = p.hit_tokens // self.block_tokens
            self.runner.ensure_pages(seq, p.hit_tokens)
            landed = self.transfer.fetch(keys[:n], seq.pages[:n], seq.prompt[: n * self.block_tokens])
            if landed == n:
                exact = p.reuse is Reuse.EXACT and self.config.sliding_layers
                return p.hit_tokens, (buf if exact and has_state(p.hit_tokens) else None)
            block_hit = landed * self.block_tokens

    def _publish(
        self, seq: Sequence, tokens: list[int], keys: list[bytes], first: int, states: dict[int, torch.Tensor]
    ) -> None:
        """Blocks ``first…`` of ``keys`` (the chain over ``tokens``, whose KV ``seq``'s pages hold) to the store,
        ``states`` to the StateBlock pool. Only for exactly computed sequences (``seq.publishing``)."""
        assert self.transfer is not None and self.store is not None
        self.transfer.store_pages(keys[first:], seq.pages[first : len(keys)], tokens)
        if states:
            state_keys = chain(self.state_namespace, np.asarray(tokens, dtype=np.uint32), self.store.hash_algo)
            for m, data in states.items():
                self.state_blocks.put(self._state_key(state_keys, m), memoryview(data.cpu().numpy()))

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
