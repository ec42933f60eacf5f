"""The engine: prompts in, tokens out (greedy, or sampled with a seed), reusing whatever prefix KV the store holds.

``generate`` runs requests whole; ``start`` returns a :class:`Generation` that a worker advances a step at a time
(prefill in chunks, then a token a step) and may abandon between steps.

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

import array
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvtier.engine.checkpoint import load, model_id
from kvtier.engine.dense import forward_logits
from kvtier.engine.family import FAMILIES
from kvtier.engine.fetch import FetcherPages, PageTransfer, StorePages
from kvtier.engine.formats import KVFormat
from kvtier.engine.reuse import Plan, Reuse, plan
from kvtier.engine.runner import Runner, Work
from kvtier.engine.sampling import GREEDY, Sampling, sample, token_logprobs
from kvtier.engine.sequence import Sequence
from kvtier.engine.sliding import STATE_INTERVAL
from kvtier.engine.stateblocks import LocalStateBlocks, StateBlocks
from kvtier.engine.store import BlockStore
from kvtier.kvstore.keys import Namespace, TokenInput, chain
from kvtier.transfer.conn import parse_addr
from kvtier.transfer.fetch_client import FetchClient
from kvtier.transfer.stateblock import StateBlockHost

# background(job, then): run ``job`` (store calls) off the stepping thread, then ``then`` on it; False: not taken
Background = Callable[[Callable[[], None], Callable[[], None]], bool]

log = logging.getLogger("kvtier.engine")


class PromptError(ValueError):
    """A prompt the model cannot take (empty, longer than its context, token ids outside its vocabulary)."""


@dataclass
class Lookup:
    """What a prefill's lookup found (:meth:`Engine._look_up`)."""

    keys: list[bytes]  # the prompt's block keys (empty without reuse)
    matched: int  # blocks ``match`` found
    hit_tokens: int  # prompt tokens whose KV is now in the sequence's pages
    state: torch.Tensor | None  # the StateBlock at ``hit_tokens`` (None: replay the hit)
    seconds: float


@dataclass
class Result:
    tokens: list[int]  # the new tokens
    hit_tokens: int  # prompt tokens whose KV was reused
    replayed: bool  # the sliding state was rebuilt by bounded replay (approximate)
    ttft_s: float  # prefill start to first token
    first_logits: torch.Tensor  # [vocab], float32: the logits the first token was sampled from
    timings: dict[str, float]  # where ``ttft_s`` went: lookup_fetch_s (match, StateBlock, blocks), replay_s, compute_s


class Engine:
    """A model with a paged cache, optionally a client of a store. Not thread-safe.

    What a page and a StateBlock hold is the model family's (``family.py``); ``block_tokens`` None takes the
    family's default (64 for the dense families, ``lcm(128, compress rates)`` for DeepSeek-V4), and a size the
    family cannot take is a ValueError (one line). ``kv_format``: the form blocks and StateBlocks take outside the
    device (``formats.py``; default ``exact``, the compute dtype's bytes); one this model cannot take is a
    ``formats.FormatError`` (one line)."""

    def __init__(
        self,
        model: nn.Module,
        model_id: str,
        store: BlockStore | None = None,
        state_blocks: StateBlocks | None = None,
        block_tokens: int | None = None,
        cache_tokens: int = 1 << 16,
        chunk_tokens: int = 512,
        kv_format: str | KVFormat = "exact",
    ) -> None:
        self.model = model
        self.config = model.config
        self.family = FAMILIES[self.config.family]
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_tokens = block_tokens = self.family.block_tokens(self.config, block_tokens)
        layout = self.family.block_layout(self.config, block_tokens)
        self.kv_format = kv_format if isinstance(kv_format, KVFormat) else KVFormat.parse(kv_format)
        block_parts, state_parts = self.family.kv_parts(self.config, block_tokens, self.dtype)
        self.block_format = self.kv_format.layout(block_parts, self.dtype, "blocks")
        self.state_format = self.kv_format.layout(state_parts, self.dtype, "StateBlocks")
        # the format is part of every key: engines of different formats never read each other's blocks
        self.namespace = Namespace(model_id, self.block_format.kv_dtype, block_tokens, layout)
        # StateBlock keys: a chain over the prompt at the granularity of both StateBlock positions and blocks
        granule = math.gcd(STATE_INTERVAL, block_tokens)
        self.state_namespace = Namespace(model_id, self.state_format.kv_dtype, granule, "swa-state")
        self.handoff = False  # also save a StateBlock at the last block boundary (a P/D prefill worker)
        pages = -(-cache_tokens // block_tokens)
        self.cache = self.family.pages(self.config, pages, block_tokens, self.dtype, self.device)
        self.runner = Runner(model, self.cache, self.family, chunk_tokens)
        # where store calls that need not hold up a step run (a worker loop's store thread); None: in the step
        self.background: Background | None = None
        self.store: BlockStore | None = None
        self.transfer: PageTransfer | None = None
        if store is not None:
            self.attach_store(store)
        self.state_blocks = state_blocks if state_blocks is not None else LocalStateBlocks(device=self.device)
        self._state_host: StateBlockHost | None = None
        self.state_bytes = self.state_format.encoded_bytes  # a stored StateBlock's; 0: no StateBlocks
        self._state_buf: torch.Tensor | None = None
        self.fetched_bytes, self.fetch_s = 0, 0.0  # every reuse's lookup and fetch: the rate a refetch would get

    def attach_store(self, store: BlockStore, fetcher: FetchClient | None = None) -> None:
        """Reuse and keep prefix KV in ``store`` (its namespace must be this engine's); blocks move through
        ``fetcher`` (the host's fetcher process) when given, else through the store client directly."""
        if store.namespace != self.namespace:
            raise ValueError("the store's namespace is not this engine's (another model, dtype or layout)")
        self.store = store
        form = self.block_format
        through_fetcher = fetcher is not None
        self.transfer = (
            FetcherPages(fetcher, store, self.cache, form) if through_fetcher else StorePages(store, self.cache, form)
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
        block_tokens: int | None = None,
        cache_tokens: int = 1 << 16,
        chunk_tokens: int = 512,
        kv_format: str = "exact",
    ) -> Engine:
        """Load the checkpoint at ``path``.

        ``store``: a cluster file, or its token-free client file, to reuse and keep prefix KV in (as the tenant of
        ``token``, default ``$KVTIER_TOKEN``, else the cluster file's own); ``fetcher``: the Unix socket of this
        host's fetcher, to move blocks through its shared-memory pool; ``directory``: ``HOST:PORT`` of the
        StateBlock directory, to share StateBlocks with other processes and hosts (this engine then serves its
        own, as ``host_id``, from a pool of ``state_pool_bytes``); otherwise ``state_blocks``, or a private
        in-process pool; ``kv_format``: see the class. ``close`` releases what this made.
        """
        model = load(path, device, dtype)
        engine = cls(model, model_id(path), None, state_blocks, block_tokens, cache_tokens, chunk_tokens, kv_format)
        if store is None:
            if fetcher is not None or directory is not None:
                raise ValueError("fetcher= and directory= need store= (the cluster file)")
            return engine
        address = parse_addr(directory) if directory is not None else None  # bad input: one line, nothing opened
        blocks = BlockStore.open(store, engine.namespace, token)
        config = blocks.client.config
        # (connected by FetcherPages, which starts the engine without it when it is not there yet)
        client = FetchClient(fetcher, token or config.token, connect=False) if fetcher is not None else None
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

    @property
    def block_bytes(self) -> int:
        """Bytes of a stored block (a page's in the ``exact`` format)."""
        return self.block_format.encoded_bytes

    def stats(self) -> dict[str, int]:
        """Counters of the tiers reuse depends on: per tier (``store``, ``fetcher``, ``directory``) whether it answers
        now (``_up``), how often it stopped (``_outages``) and came back (``_recoveries``), and calls that found it
        away (``_failed_calls``); ``fetcher_unstaged_blocks``: blocks moved (read or stored) by the store client
        because the fetcher was away or could not stage them."""
        out: dict[str, int] = {}
        if self.store is not None:
            out |= self.store.availability.stats("store")
        if isinstance(self.transfer, FetcherPages):
            out |= self.transfer.stats()
        if self._state_host is not None:
            out |= self._state_host.directory_availability.stats("directory")
        return out

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API -----------------------------------------------------------------------------------

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of one full forward: no cache, no store."""
        return forward_logits(self.model, torch.from_numpy(self._ids(tokens).astype(np.int64)).to(self.device))

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        reuse: bool = True,
        resume: bool = False,
        sampling: Sampling = GREEDY,
    ) -> list[Result]:
        """Continuations (greedy unless ``sampling`` says otherwise), one :class:`Result` per prompt (in order).

        ``reuse=False`` neither reads nor writes the store. ``resume=True`` is the decode worker's mode
        (P/D): the prompt was prefilled elsewhere, so reuse every stored block up to the last block boundary
        (with the prefill worker's StateBlock there), recompute at most the last block, and store nothing.
        Raises PromptError for a prompt the model cannot take (every prompt is checked before any work).
        """
        checked = [self._ids(p) for p in prompts]
        results = []
        for p, ids in zip(prompts, checked, strict=True):
            with self._start(p, ids, max_new_tokens, sampling, reuse, resume) as g:
                while not g.finish_reason:
                    g.step()
                results.append(g.result())
        return results

    def start(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        reuse: bool = True,
        resume: bool = False,
        first_token: int | None = None,
        ids: np.ndarray | None = None,
    ) -> Generation:
        """One request, to be advanced step by step (:meth:`Generation.step`) and closed; nothing runs yet.

        ``first_token``: the answer's first token as a prefill worker chose it (P/D), used instead of sampling
        one from this engine's logits; ``ids``: the prompt as :meth:`check_prompt` returned it (not converted
        again: 4 ms at 77K tokens). Raises PromptError for a prompt the model cannot take."""
        ids = self._ids(prompt) if ids is None else ids
        return self._start(prompt, ids, max_new_tokens, sampling, reuse, resume, first_token)

    def _start(
        self,
        prompt: list[int],
        ids: np.ndarray,
        max_new_tokens: int,
        sampling: Sampling,
        reuse: bool,
        resume: bool,
        first_token: int | None = None,
    ) -> Generation:
        """:meth:`start` for a prompt already checked and converted (``ids``, from ``_ids``)."""
        if max_new_tokens < 0:
            raise PromptError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        seq = Sequence(list(prompt), ids)
        seq.state = self.family.new_state(self.config, self.cache, seq, 0)
        self.runner.ensure_pages(seq, len(prompt) // self.block_tokens * self.block_tokens)  # (see _look_up)
        budget = min(max_new_tokens, self.config.max_position_embeddings - len(prompt))
        return Generation(self, seq, budget, sampling, reuse, resume, first_token)

    def check_prompt(self, prompt: list[int]) -> np.ndarray:
        """``prompt`` as the ids :meth:`start` takes, or PromptError (one line) if the model cannot take it: empty,
        longer than its context, or token ids outside its vocabulary (or not integers)."""
        return self._ids(prompt)

    # -- one request ----------------------------------------------------------------------------------

    def _look_up(self, seq: Sequence, reuse: bool, resume: bool, fetch: bool = True, exact: bool = False) -> Lookup:
        """The store's part of a prefill's start: the prompt's keys, ``match``, the hit rule (asking the StateBlock
        pool), and the fetch of what it reuses into the sequence's pages. ``fetch`` off: reuse nothing (the keys
        are still made, to publish with); ``exact``: reuse only what is exact (a hit without its StateBlock is not
        replayed but recomputed: a preempted request's resume).

        It touches only this sequence's pages, which hold the prompt's full blocks already (:meth:`_start`
        allocates them), the store's connections and the StateBlock buffer: it may run on another thread while
        this engine steps other sequences, so long as every store call of the engine runs on that thread."""
        start = time.perf_counter()
        keys = self.store.keys(seq.prefill_ids()) if self.store is not None and reuse else []
        matched = self.store.match(keys) if keys and fetch else 0
        h, state = self._reuse(seq, keys, matched, resume)
        if state is not None:
            # decoded from the KV format into a tensor of its own, or (exact) copied: the StateBlock buffer
            # is the next lookup's
            state = state.clone() if self.state_format.identity else self.state_format.decode(state[None])[0]
        elif h and exact and self.state_bytes:
            h = 0  # the hit needs a replay: recompute it (over the fetched pages) instead
        seconds = self._clock() - start
        if h:
            self.fetched_bytes += h // self.block_tokens * self.block_bytes
            self.fetch_s += seconds
        return Lookup(keys, matched, h, state, seconds)

    def _begin_prefill(self, seq: Sequence, found: Lookup, resume: bool) -> None:
        """The rest of a prefill's start, on the stepping thread: the sequence's state from the StateBlock ``found``,
        or bounded replay of the hit."""
        h = found.hit_tokens
        replaying = self._clock()
        if found.state is not None:
            seq.state = self.family.restore(self.config, self.cache, seq, found.state, h)
        elif h and self.state_bytes:  # block KV without its StateBlock: bounded replay
            first = max(0, h - self.family.replay_tokens(self.config))  # the last min(W, h) tokens of the hit
            log.info(
                "no StateBlock at position %d of a %d-token prompt: bounded replay of positions %d-%d "
                "(approximate; nothing of this request is stored)", h, len(seq.prompt), first, h - 1
            )  # fmt: skip
            seq.state = self.family.new_state(self.config, self.cache, seq, first)
            self.runner.run(seq, first, h, write_global=False)
            seq.replayed = True
        seq.hit_tokens = h
        seq.publishing = bool(found.keys) and not seq.replayed and not resume
        seq.timings = {"lookup_fetch_s": found.seconds, "replay_s": self._clock() - replaying}

    def _clock(self) -> float:
        """``time.perf_counter()`` once the device has done the work queued so far (GPU work is asynchronous)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @staticmethod
    def _saver(seq: Sequence, states: dict[int, torch.Tensor]) -> Callable[[int], None]:
        """``on_state`` for the runner: keep the StateBlock of ``seq`` at each position it is called with."""
        return lambda m: states.update({m: seq.state.state_block(m)})

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
        ids = seq.prefill_ids()
        state_keys = chain(self.state_namespace, ids, self.store.hash_algo)
        found: dict[int, torch.Tensor | None] = {}

        def has_state(h: int) -> bool:
            if h not in found:  # (a lookup may fill the one staging buffer: only the last one asked is kept)
                found.clear()
                found[h] = self._state(self._state_key(state_keys, h))
            return found[h] is not None

        block_hit = matched * self.block_tokens
        while True:
            p: Plan = plan(
                seq.prefill,
                block_hit,
                self.block_tokens,
                self.config.sliding_window if self.state_bytes else None,
                has_state,
                resume,
                margin=self.family.hit_margin(self.config),
            )
            if p.reuse is Reuse.NONE:
                return 0, None
            n = p.hit_tokens // self.block_tokens
            self.runner.ensure_pages(seq, p.hit_tokens)
            landed = self.transfer.fetch(keys[:n], seq.pages[:n], ids[: n * self.block_tokens])
            if landed == n:
                exact = p.reuse is Reuse.EXACT and self.state_bytes
                return p.hit_tokens, (found[p.hit_tokens] if exact and has_state(p.hit_tokens) else None)
            block_hit = landed * self.block_tokens

    def _publish(
        self, seq: Sequence, tokens: TokenInput, keys: list[bytes], first: int, states: dict[int, torch.Tensor]
    ) -> None:
        """Blocks ``first…`` of ``keys`` (the chain over ``tokens``, whose KV ``seq``'s pages hold) to the store,
        ``states`` to the StateBlock pool. Only for exactly computed sequences (``seq.publishing``). The StateBlocks
        go first: a lookup that finds the blocks then finds them too (blocks first, a request arriving between the
        two found the blocks without their StateBlock and replayed the window: approximate where it could be exact)."""
        assert self.transfer is not None and self.store is not None
        if states:
            state_keys = chain(self.state_namespace, np.asarray(tokens, dtype=np.uint32), self.store.hash_algo)
            local = isinstance(self.state_blocks, LocalStateBlocks)  # (takes the tensor as it is, on its device)
            for m, data in states.items():
                data = self.state_format.encode(data[None])[0]  # (in the KV format, encoded on the device)
                self.state_blocks.put(self._state_key(state_keys, m), data if local else memoryview(data.cpu().numpy()))
        self.transfer.store_pages(keys[first:], seq.pages[first : len(keys)], tokens)

    def _state(self, key: bytes) -> torch.Tensor | None:
        """The StateBlock ``key`` (flat uint8), or None if the pool does not hold it."""
        if isinstance(self.state_blocks, LocalStateBlocks):
            return self.state_blocks.get(key)
        buf = self._state_buffer
        return buf if self.state_blocks.get_into(key, memoryview(buf.numpy())) else None

    def _ids(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """``tokens`` as uint32 (what keys are chained over), or PromptError (one line) if the model cannot take
        them: empty, longer than its context, or ids outside its vocabulary."""
        n, limit, vocab = len(tokens), self.config.max_position_embeddings, self.config.vocab_size
        if n == 0:
            raise PromptError("empty prompt: give at least one token")
        if n > limit:
            raise PromptError(f"prompt of {n} tokens is longer than the model's context of {limit} tokens")
        if isinstance(tokens, np.ndarray) and (tokens.ndim != 1 or tokens.dtype.kind not in "iu"):
            kind = f"{tokens.ndim}-D {tokens.dtype}"
            raise PromptError(f"token ids must be integers in 0…{vocab - 1}, one row; got a {kind} array")
        try:  # through array.array: a third of numpy's time for a list of ints (3.9 ms at 77K tokens)
            ids = (
                tokens.astype(np.int64)
                if isinstance(tokens, np.ndarray)
                else np.frombuffer(array.array("q", tokens), np.int64)
            )
        except (TypeError, OverflowError) as e:
            raise PromptError(f"token ids must be integers in 0…{vocab - 1}: {e}") from None
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise PromptError(f"token ids must be in 0…{vocab - 1}; got {lo}…{hi}")
        return ids.astype(np.uint32)

    @property
    def _state_buffer(self) -> torch.Tensor:
        """Where a StateBlock lands on its way to the device: one buffer, pinned on a GPU engine (a fresh pageable
        one cost 2 ms of page faults and 2.5 ms of copy per request at 13 MB)."""
        if self._state_buf is None:
            pin = self.device.type == "cuda" and self.state_bytes > 0
            self._state_buf = torch.empty(self.state_bytes, dtype=torch.uint8, pin_memory=pin)
        return self._state_buf


class Generation:
    """One request in progress on an engine (made by :meth:`Engine.start`): its prompt's prefill in steps of
    whole runner chunks, then one token a step. Several may be in progress on one engine at once (their pages
    are their own), advanced alone (:meth:`step`) or together, one forward for all (:meth:`work` for each, one
    ``Runner.forward``, :meth:`take` for each: what ``engine.scheduler.Scheduler`` does). ``close`` (or the
    ``with`` block) releases its pages, whether it finished or was abandoned half way (an abort); :meth:`preempt`
    gives them back too, and the request goes on later as if it had never stopped."""

    def __init__(
        self,
        engine: Engine,
        seq: Sequence,
        budget: int,
        sampling: Sampling,
        reuse: bool,
        resume: bool,
        first_token: int | None,
    ) -> None:
        self.engine, self.seq, self.budget, self.sampling = engine, seq, budget, sampling
        self.reuse, self.resume, self.first_token = reuse, resume, first_token
        self.computed: int | None = None  # prefill positions in the cache; None until the lookup ran
        self.finish_reason: str | None = None  # "stop" (a stop token) or "length"; None while running
        self.first_logits: torch.Tensor | None = None
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per token, with ``sampling.logprobs``
        self.released = False  # its pages went back to the cache
        self.on_release: Callable[[], None] | None = None  # called then (on the stepping thread)
        self.preemptions = 0
        self.preempting = False  # preempted, its pages not back yet (a store call in the background uses them)
        self.refetch = True  # a resume reuses the store's blocks of its tokens (else recomputes them)
        self._found: Lookup | None = None
        self._stored = 0  # leading blocks of its tokens the store holds (found or published)
        self._holds = 0  # store calls in the background that use its pages
        self._states: dict[int, torch.Tensor] = {}  # StateBlocks this request computed, by position
        self._state_at: list[int] = []
        self._started = 0.0
        self._computing = 0.0
        self._work: Work | None = None
        self._closed = False

    @property
    def prompt_left(self) -> int:
        """Prefill positions still to compute (the whole prompt before the lookup ran; after a preemption every
        token so far)."""
        return self.seq.prefill - (self.computed or 0)

    @property
    def cached(self) -> int:
        """Positions whose KV the cache holds: the reused prefix plus what was computed since."""
        return (self.computed or 0) + max(0, len(self.seq.tokens) - self.seq.prefill - 1)

    @property
    def holding(self) -> bool:
        """Whether store calls in the background use its pages now (they cannot go back before those end)."""
        return self._holds > 0

    @property
    def restorable_blocks(self) -> int:
        """Leading blocks of its tokens the store would give back to a resume after :meth:`preempt` with refetch:
        every full block it computed when it publishes, else those its lookup found."""
        if self.computed is None:
            return 0
        return self.cached // self.engine.block_tokens if self.seq.publishing else self._stored

    def step(self, max_prefill_tokens: int | None = None) -> int | None:
        """Advance by one step and return the token it produced, or None (a prefill step that did not reach the
        prompt's end, or a request that produces no tokens).

        While prefilling (the first step also looks up and fetches the reused prefix): computes up to
        ``max_prefill_tokens`` more prompt positions (None: all), rounded down to the runner's chunk boundaries
        but at least one chunk, so equal prefixes are always computed in equal pieces; the step that completes
        the prompt publishes its blocks and yields the first token. Afterwards each step computes one token.
        Sets ``finish_reason`` on the last token."""
        return self.take(self.engine.runner.forward([self.work(max_prefill_tokens)])[0])

    def work(self, max_prefill_tokens: int | None = None) -> Work:
        """What this request computes in its next step (:meth:`step`'s rules), for a forward with others; the
        first call also looks the prompt up and fetches what it reuses (unless :meth:`lookup` ran). Hand the
        logits of the forward to :meth:`take` before asking for the next."""
        assert not self.finish_reason and not self._closed and self._work is None, "work() out of turn"
        engine, seq = self.engine, self.seq
        if self.computed is None:
            self._begin()
        assert self.computed is not None
        if self.computed < seq.prefill:
            start, chunk = self.computed, engine.runner.chunk_tokens
            end = seq.prefill
            if max_prefill_tokens is not None:
                end = min(end, max(start // chunk + 1, (start + max_prefill_tokens) // chunk) * chunk)
            self._computing = engine._clock()
            self._work = Work(seq, start, end, True, self._state_at, engine._saver(seq, self._states))
        else:
            pos = len(seq.tokens) - 1
            at = [pos + 1] if (pos + 1) % STATE_INTERVAL == 0 else []
            save = engine._saver(seq, self._states) if seq.publishing and engine.state_bytes else None
            self._work = Work(seq, pos, pos + 1, True, at, save)
        return self._work

    def take(self, logits: torch.Tensor) -> int | None:
        """The logits [vocab] of the last position of :meth:`work`'s span: what the step produced (:meth:`step`)."""
        work, self._work = self._work, None
        assert work is not None, "take() without work()"
        if work.end <= self.seq.prefill:
            return self._prefilled(work.end, logits)
        return self._emit(logits)

    def _begin(self) -> None:
        """The first step's start: the lookup (unless it ran), then the state from its StateBlock or replay."""
        engine, seq = self.engine, self.seq
        if self._found is None:
            self.lookup()
        assert self._found is not None
        if not self.preemptions:
            engine._begin_prefill(seq, self._found, self.resume)
        else:  # a resume: what the request reports stays its first prefill's
            reported = seq.hit_tokens, seq.replayed, seq.timings, seq.publishing
            engine._begin_prefill(seq, self._found, self.resume)
            seq.hit_tokens, seq.replayed, seq.timings, seq.publishing = reported
        self.computed = self._found.hit_tokens
        self._stored = max(self._found.matched, self.computed // engine.block_tokens)
        if seq.publishing and engine.state_bytes:
            self._state_at = engine._state_positions(self.computed, seq.prefill)

    def _prefilled(self, end: int, logits: torch.Tensor) -> int | None:
        engine, seq = self.engine, self.seq
        self.computed = end
        now = engine._clock()
        seq.timings["compute_s"] = seq.timings.get("compute_s", 0.0) + now - self._computing
        if end < seq.prefill:
            return None
        if seq.publishing:
            assert self._found is not None
            self._publish(seq.prefill_ids(), self._found.keys, self._stored, self._states)
            self._stored = len(self._found.keys)
        self._states = {}
        if self.first_logits is not None:  # a resume: its last logits choose the next token, as a decode step would
            return self._emit(logits)
        seq.ttft_s = now - self._started
        self.first_logits = logits
        if self.budget == 0:
            self.finish_reason = "length"
            return None
        return self._emit(logits)

    def _emit(self, logits: torch.Tensor) -> int:
        seq = self.seq
        index = len(seq.generated)
        if index == 0 and self.first_token is not None:
            token = self.first_token
        else:
            token = sample(logits, self.sampling, index, seq.ids, seq.generated)
        if self.sampling.logprobs is not None:
            self.logprobs.append(token_logprobs(logits, token, self.sampling.logprobs))
        seq.generated.append(token)
        if token in self.sampling.stop_token_ids:
            self.finish_reason = "stop"
        elif len(seq.generated) >= self.budget:
            self.finish_reason = "length"
        if self.finish_reason:
            self._publish_decoded()
        return token

    def _publish_decoded(self) -> None:
        """The blocks decode completed (the last token has no KV yet) and its StateBlocks, to the store."""
        engine, seq = self.engine, self.seq
        if seq.publishing and len(seq.generated) > 1:
            computed = np.asarray(seq.tokens[:-1], dtype=np.uint32)  # once: the block chain and the state chain
            self._publish(computed, None, seq.prefill // engine.block_tokens, self._states)

    def stop_for_length(self) -> None:
        """End the answer here (``"length"``): the cache cannot hold it any longer, even alone."""
        self.finish_reason = "length"
        self._publish_decoded()

    def preempt(self, refetch: bool) -> None:
        """Give every page back (now, or when the store calls in the background that use them end:
        ``preempting`` until then); the next step computes every token so far again, as a prompt whose last
        logits choose the next token, reusing what the store holds of them when ``refetch`` (what this request
        computed is published first, when it publishes) or recomputing it all. The answer goes on as if nothing
        had happened: a choice depends only on the logits, the settings and the tokens before it."""
        assert self._work is None and not self.finish_reason and not self.preempting
        seq = self.seq
        self.refetch = refetch
        if self.computed is not None:
            if refetch and seq.publishing and self.cached:
                computed = np.asarray(seq.tokens[: self.cached], dtype=np.uint32)
                states = {m: s for m, s in self._states.items() if m <= self.cached}
                self._publish(computed, None, self._stored, states)
            seq.prefill = len(seq.tokens) if seq.generated else seq.prefill
            self.preemptions += 1
        self.preempting = True
        if not self._holds:
            self._drop()

    def _drop(self) -> None:
        """A preemption's end: the pages back, the state as at the sequence's start."""
        engine, seq = self.engine, self.seq
        engine.cache.release(seq.pages)
        seq.pages = []
        seq.state = engine.family.new_state(engine.config, engine.cache, seq, 0)
        self.computed, self._found, self._states, self.preempting = None, None, {}, False
        if self.on_release is not None:
            self.on_release()

    def _publish(
        self, tokens: np.ndarray, keys: list[bytes] | None, first: int, states: dict[int, torch.Tensor]
    ) -> None:
        """Blocks ``first…`` of the chain over ``tokens`` (``keys``, or chained here) and ``states`` to the store: now,
        or in the engine's ``background`` (nothing is stored when it refuses: the store is too slow)."""
        engine, seq = self.engine, self.seq
        store = engine.store
        assert store is not None

        def put() -> None:
            engine._publish(seq, tokens, keys if keys is not None else store.keys(tokens), first, states)

        if engine.background is None:
            put()
        else:
            self.in_background(put)

    def lookup(self) -> None:
        """The first step's store part (:meth:`Engine._look_up`), run once: by ``step`` when it has not run, or
        before, through :meth:`in_background`, while the engine steps other requests. A resume's reuses only what
        is exact, and nothing unless ``refetch``."""
        if not self.preemptions:
            self._started = time.perf_counter()
            self._found = self.engine._look_up(self.seq, self.reuse, self.resume)
        else:
            self._found = self.engine._look_up(self.seq, self.reuse, self.resume, self.refetch, exact=True)

    @property
    def looked_up(self) -> bool:
        return self._found is not None

    def in_background(self, job: Callable[[], None], then: Callable[[], None] | None = None) -> bool:
        """Run ``job`` (store calls on this request's pages) with the engine's ``background``, holding the pages
        until it ends: a ``close`` meanwhile releases them only then. ``then`` runs after it, on the stepping
        thread. False (nothing done) without a background, or when it refuses the job."""
        background = self.engine.background
        if background is None:
            return False
        self._holds += 1

        def ended() -> None:
            self._holds -= 1
            if then is not None:
                then()
            if self._closed and not self._holds:
                self._release()
            elif self.preempting and not self._holds:
                self._drop()

        if background(job, ended):
            return True
        self._holds -= 1
        return False

    def result(self) -> Result:
        """What the request did, once it finished."""
        assert self.finish_reason and self.first_logits is not None
        seq = self.seq
        return Result(seq.generated, seq.hit_tokens, seq.replayed, seq.ttft_s, self.first_logits, seq.timings)

    def close(self) -> None:
        """Release the request's pages (idempotent; once store calls in the background that use them have ended).
        A request closed before it finished stores nothing more."""
        if not self._closed:
            self._closed = True
            if not self._holds:
                self._release()

    def _release(self) -> None:
        self.engine.cache.release(self.seq.pages)
        self.released = True
        if self.on_release is not None:
            self.on_release()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
