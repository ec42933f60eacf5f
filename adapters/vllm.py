"""vLLM secondary offloading tier: kvtier behind vLLM's CPU offloading tier (vllm 0.33.0, ``TieringOffloadingSpec``).

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.adapters.vllm",
                                 "config": "/srv/kvtier/cluster.toml"}]}}'

vLLM's ``SecondaryTierFactory`` imports this module, takes :class:`KvtierTier` (a ``SecondaryTierManager``) and
builds it with the tier's other keys as keyword arguments: ``config`` (required), ``token`` or ``token_file``,
``ttl_class``, ``timeout_s``, ``namespace`` (:class:`~kvtier.adapters.store.StoreSettings`), ``io_threads``
(default 2) and ``fetcher`` (the socket of a ``kvtier-fetcher`` on this host: reads and writes then go through
its host pool, shared by the host's engines).

The contract was read from vLLM 0.33.0's ``vllm/v1/kv_offload/tiering/base.py`` and ``manager.py``. Its logic is
:class:`TierCore`, in plain types, so that it is tested without vLLM (whose wheel is 336 MB) against a double of
what vLLM's ``TieringOffloadingManager`` checks; :class:`KvtierTier` only converts to and from vLLM's types.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvtier.adapters.hosts import host_class
from kvtier.adapters.store import AdapterStore, Keyspace, SettingsError, StoreSettings
from kvtier.transfer.fetch_client import FetchClient

log = logging.getLogger("kvtier.adapters.vllm")

SecondaryTierManager = host_class("vllm", "vllm.v1.kv_offload.tiering.base", "SecondaryTierManager")

DEFAULT_IO_THREADS = 2


class Finished(NamedTuple):
    """A job's one report: whether every chunk moved; for a partly failed load, the keys that did."""

    job_id: int
    success: bool
    loaded_keys: tuple[bytes, ...] | None
    transfer_bytes: int
    transfer_s: float


@dataclasses.dataclass
class _Lookup:
    """One key's existence probe: pending (in this step's batch), in flight, or resolved to ``found``."""

    requests: set[str]
    found: bool | None = None
    in_flight: bool = False


class TierCore:
    """What a kvtier secondary tier does, with no vLLM type in it.

    - ``lookup`` never blocks: the first call for a key queues it, ``flush_lookups`` (once per scheduler step)
      hands the step's keys to a probe thread as one batched store call, and a later call answers True or False;
      until then it answers None (vLLM's RETRY). A key stays answered while a request refers to it; a load
      that failed turns its answer to False (vLLM would otherwise promote it again and again).
    - ``submit`` never blocks: a job is one batched store call on an I/O thread, between primary chunk rows
      ``chunk_ids`` (``block_size`` bytes each, the primary view's stride) and the store. Each job is reported by
      ``finished`` exactly once, also when its chunk ids are out of range or the store fails (a failure).
    - ``drain`` returns once every submitted job has run; nothing touches the primary view after it.
    """

    def __init__(
        self,
        store: AdapterStore,
        keyspace: Keyspace,
        primary_view: memoryview,
        io_threads: int = DEFAULT_IO_THREADS,
        fetcher: Path | None = None,
    ) -> None:
        if primary_view.strides is None or primary_view.ndim < 1 or not primary_view.c_contiguous:
            raise SettingsError("the primary KV view must be a C-contiguous array of chunk rows")
        self.store = store
        self.keyspace = keyspace
        self.block_size = primary_view.strides[0]
        self.chunks = primary_view.shape[0] if primary_view.shape else 0
        self._rows = primary_view.cast("B")
        self._fetcher = fetcher
        self._fetch_clients = threading.local()
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-vllm-io")
        self._probe = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-lookup")
        self._lookups: dict[bytes, _Lookup] = {}
        self._asked: dict[str, set[bytes]] = {}  # per request, the keys it looked up
        self._batch: list[bytes] = []
        self._answers: queue.SimpleQueue[tuple[list[bytes], list[bool]]] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self._jobs: set[int] = set()
        self._loads: dict[int, list[bytes]] = {}  # keys of loads in flight (scheduler thread)
        self._idle = threading.Condition()

    # --- lookups (scheduler thread) -----------------------------------------------------------------------------

    def lookup(self, key: bytes, request: str) -> bool | None:
        """True (stored), False (not), or None: not known yet, ask again next step."""
        self._apply_answers()
        state = self._lookups.get(key)
        if state is None:
            state = self._lookups[key] = _Lookup(set())
            self._batch.append(key)
        state.requests.add(request)
        self._asked.setdefault(request, set()).add(key)
        return state.found

    def flush_lookups(self) -> None:
        """Send this step's new keys to the probe thread as one store call (vLLM: ``on_schedule_end``)."""
        self._apply_answers()
        batch, self._batch = self._batch, []
        batch = [k for k in batch if k in self._lookups]
        for key in batch:
            self._lookups[key].in_flight = True
        if batch:
            self._probe.submit(self._probe_keys, batch)

    def _probe_keys(self, keys: list[bytes]) -> None:
        self._answers.put((keys, self.store.exists(self.keyspace.keys(keys)[0])))

    def _apply_answers(self) -> None:
        while True:
            try:
                keys, found = self._answers.get_nowait()
            except queue.Empty:
                return
            for key, hit in zip(keys, found, strict=True):
                state = self._lookups.get(key)
                if state is None:
                    continue
                state.in_flight = False
                if not state.requests:
                    del self._lookups[key]
                elif state.found is None:
                    state.found = hit

    def request_finished(self, request: str) -> None:
        """Forget ``request``'s lookups (probes in flight stay until answered)."""
        self._apply_answers()
        for key in self._asked.pop(request, ()):
            state = self._lookups.get(key)
            if state is None:
                continue
            state.requests.discard(request)
            if not state.requests and not state.in_flight:
                del self._lookups[key]

    # --- jobs -----------------------------------------------------------------------------------------------

    def submit(self, job_id: int, keys: Sequence[bytes], chunk_ids: np.ndarray, load: bool) -> None:
        """Start moving ``keys``' chunks between primary rows ``chunk_ids`` and the store; returns at once."""
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} was submitted twice")
        keys = list(keys)
        if load:
            self._loads[job_id] = keys
        with self._idle:
            self._jobs.add(job_id)
        self._io.submit(self._run, job_id, keys, np.asarray(chunk_ids), load)

    def _run(self, job_id: int, keys: list[bytes], chunk_ids: np.ndarray, load: bool) -> None:
        started = time.monotonic()
        moved: list[bool] = [False] * len(keys)
        try:
            rows = self._chunk_rows(keys, chunk_ids)
            mapped = self.keyspace.keys(keys)
            moved = (self._load if load else self._store)(mapped, rows)
        except Exception as exc:  # a job that cannot run is reported failed, never raised
            log.warning("kvtier vLLM tier: job %d failed: %s", job_id, exc)
        success = all(moved)
        loaded = None
        if load and not success and any(moved):
            loaded = tuple(k for k, ok in zip(keys, moved, strict=True) if ok)
        done = Finished(job_id, success, loaded, self.block_size * sum(moved), time.monotonic() - started)
        with self._idle:
            self._finished.put(done)
            self._jobs.discard(job_id)
            self._idle.notify_all()

    def _chunk_rows(self, keys: list[bytes], chunk_ids: np.ndarray) -> list[memoryview]:
        if len(chunk_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(chunk_ids)} chunk ids")
        ids = [int(c) for c in chunk_ids]
        bad = [c for c in ids if not 0 <= c < self.chunks]
        if bad:
            raise ValueError(f"chunk ids {bad[:4]} are outside the primary tier's {self.chunks} chunks")
        size = self.block_size
        return [self._rows[c * size : (c + 1) * size] for c in ids]

    def _store(self, mapped: tuple[list[bytes], list[bytes]], rows: list[memoryview]) -> list[bool]:
        fetch = self._fetch_client()
        if fetch is not None:
            stored = self._through_fetcher(fetch, lambda c: _put_via(c, mapped, rows, self.store.settings.ttl_class))
            if stored is not None:
                return stored
        return self.store.put(mapped[0], mapped[1], rows)

    def _load(self, mapped: tuple[list[bytes], list[bytes]], rows: list[memoryview]) -> list[bool]:
        fetch = self._fetch_client()
        if fetch is not None:
            loaded = self._through_fetcher(fetch, lambda c: _fetch_via(c, mapped, rows))
            if loaded is not None:
                return loaded
        return self.store.get_into(mapped[0], mapped[1], rows)

    def _fetch_client(self) -> FetchClient | None:
        """This I/O thread's fetcher client, or None without a fetcher (or while it cannot be reached)."""
        if self._fetcher is None:
            return None
        client = getattr(self._fetch_clients, "client", None)
        if client is None:
            token = self.store.settings.token or self.store.config.token
            try:
                client = FetchClient(self._fetcher, token, timeout_s=self.store.settings.timeout_s)
            except Exception as exc:  # no fetcher: the store is read directly
                log.warning(
                    "kvtier vLLM tier: fetcher %s unreachable (%s); reading the store directly", self._fetcher, exc
                )
                return None
            self._fetch_clients.client = client
        return client

    def _through_fetcher(self, client: FetchClient, call: Callable[[FetchClient], list[bool]]) -> list[bool] | None:
        """``call`` through the fetcher, or None (then the store is used directly) if the fetcher failed."""
        try:
            return call(client)
        except Exception as exc:  # the fetcher failing is not the engine's error
            log.warning("kvtier vLLM tier: fetcher call failed (%s); using the store directly", exc)
            client.close()
            self._fetch_clients.client = None
            return None

    def finished(self) -> list[Finished]:
        """Every job that ended since the last call, each reported once (scheduler thread). The keys a load did
        not bring answer False from now on, so that the scheduler does not promote them again."""
        out: list[Finished] = []
        while True:
            try:
                done = self._finished.get_nowait()
            except queue.Empty:
                return out
            out.append(done)
            keys = self._loads.pop(done.job_id, [])
            if not done.success:
                self._forget(set(keys) - set(done.loaded_keys or ()))

    def _forget(self, keys: Collection[bytes]) -> None:
        for key in keys:
            state = self._lookups.get(key)
            if state is not None and state.found is not None:
                state.found = False

    def pending(self) -> bool:
        """Jobs running or not yet reported, or probes not yet answered: the engine must keep stepping."""
        with self._idle:
            running = bool(self._jobs)
        return running or not self._finished.empty() or any(s.in_flight for s in self._lookups.values())

    def drain(self) -> None:
        """Wait until every submitted job has run (its result is then in ``finished``)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._jobs)

    def shutdown(self) -> None:
        """Stop the threads (jobs in flight run to their end) and let go of the primary view."""
        self._probe.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._rows.release()
        self.store.close()


def _fetch_via(client: FetchClient, mapped: tuple[list[bytes], list[bytes]], rows: list[memoryview]) -> list[bool]:
    """Blocks into the fetcher's host pool (hits are served from it), then copied into the primary rows."""
    size = len(rows[0]) if rows else 0
    with client.fetch(mapped[0], size, headers=mapped[1]) as blocks:
        ok = blocks.ok().tolist()
        for i, found in enumerate(ok):
            if found:
                rows[i][:] = blocks[i].view()
    return ok


def _put_via(
    client: FetchClient, mapped: tuple[list[bytes], list[bytes]], rows: list[memoryview], ttl_class: str
) -> list[bool]:
    """Rows copied into slots of the fetcher's host pool, stored from there (and kept there as hits)."""
    size = len(rows[0]) if rows else 0
    slots = client.alloc(len(rows), size)
    if not slots.ok().all():
        client.release(slots)
        raise RuntimeError("the fetcher's pool has no free slots")
    for slot, row in zip(slots, rows, strict=True):
        slot.view()[:] = row
    return client.put(mapped[0], list(slots), ttl_class, headers=mapped[1])


def identity(spec_config: Any, block_size: int, namespace: str) -> dict[str, Any]:
    """What makes two chunk rows interchangeable, from vLLM's ``OffloadingConfig`` (the spec's ``config``)."""
    parallel = spec_config.parallel
    return {
        "engine": "vllm",
        "model": spec_config.model.name,
        "dtype": str(spec_config.model.dtype),
        "tokens_per_hash": spec_config.cache.tokens_per_hash,
        "blocks_per_chunk": spec_config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in spec_config.groups],
        "parallel": [parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "layout": [spec_config.kv_cache_layout, spec_config.canonical_layout, spec_config.replicated_layout],
        "chunk_bytes": block_size,
        "namespace": namespace,
    }


def _vllm_attr(module: str, name: str, member: str) -> Any:
    """``module.name.member`` when vLLM is installed (a class attribute the tier declares), else None."""
    try:
        import importlib

        return getattr(getattr(importlib.import_module(module), name), member)
    except ImportError:
        return None


class KvtierTier(SecondaryTierManager):  # type: ignore[misc, valid-type]
    """
    KvtierTier is a secondary tier of vLLM's offloading connector that keeps chunks in a kvtier cluster.

    Chunks move between the CPU primary tier's rows (``primary_kv_view``; a chunk is one row, its size the
    view's stride) and the store, one kvtier block a chunk, received into and sent from the rows themselves
    (through a local ``kvtier-fetcher``'s host pool when ``fetcher`` is set). Keys are vLLM's offload keys within
    a keyspace of the model, dtype, chunk geometry, KV cache groups, parallel sizes, layout and the optional
    ``namespace``.

    Every method is non-blocking, as vLLM requires: ``lookup`` answers RETRY until the step's batched probe has
    answered, then HIT or MISS; ``submit_store``/``submit_load`` queue one batched store call each;
    ``get_finished_jobs`` reports each job once (a load that moved some chunks names them in
    ``successful_keys``). A store that is down or slow makes misses and failed jobs, never an exception, and no
    job waits on it much longer than ``timeout_s``. ``drain_jobs`` waits for the jobs in flight.
    """

    medium = _vllm_attr("vllm.v1.kv_offload.base", "Medium", "STORAGE")

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        config: str | None = None,  # required: StoreSettings refuses its absence in one line, not a TypeError
        token: str | None = None,
        token_file: str | None = None,
        ttl_class: str = "chatbot",
        timeout_s: float = 5.0,
        namespace: str = "",
        io_threads: int = DEFAULT_IO_THREADS,
        fetcher: str | None = None,
        locality: str | None = None,
        backpressure_detector: Any = None,
        **unknown: Any,
    ) -> None:
        where = f"secondary tier {tier_type}"
        if unknown:  # vLLM's factory passes every key of the tier's config: a misspelt one would be a TypeError
            raise SettingsError(f"{where}: unknown setting(s) {', '.join(sorted(unknown))}")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        from vllm.v1.kv_offload.base import Locality, LookupResult, RequestOffloadingContext
        from vllm.v1.kv_offload.tiering.base import JobResult

        self._types = (LookupResult, RequestOffloadingContext, JobResult)
        self.locality = Locality(locality) if locality is not None else None
        values = {"config": config, "ttl_class": ttl_class, "timeout_s": timeout_s, "namespace": namespace}
        values.update({k: v for k, v in (("token", token), ("token_file", token_file)) if v is not None})
        settings = StoreSettings.from_mapping(values, where)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise SettingsError(f"{where}: io_threads must be a positive integer, got {io_threads!r}")
        store = AdapterStore(settings, f"kvtier vLLM tier {tier_type}")
        keys = Keyspace(identity(offloading_spec.config, self.block_size_bytes, namespace))
        self.core = TierCore(store, keys, primary_kv_view, io_threads, Path(fetcher) if fetcher else None)

    def lookup(self, key: bytes, req_context: Any) -> Any:
        lookup_result = self._types[0]
        found = self.core.lookup(bytes(key), req_context.req_id)
        if found is None:
            return lookup_result.RETRY
        return lookup_result.HIT if found else lookup_result.MISS

    def on_schedule_end(self, context: Any) -> None:
        self.core.flush_lookups()

    def on_new_request(self, req_context: Any) -> Any:
        return self._types[1]()

    def on_request_finished(self, req_context: Any) -> None:
        self.core.request_finished(req_context.req_id)

    def submit_store(self, job_metadata: Any) -> None:
        self.core.submit(job_metadata.job_id, [bytes(k) for k in job_metadata.keys], job_metadata.chunk_ids, False)

    def submit_load(self, job_metadata: Any) -> None:
        self.core.submit(job_metadata.job_id, [bytes(k) for k in job_metadata.keys], job_metadata.chunk_ids, True)

    def get_finished_jobs(self) -> list[Any]:
        job_result = self._types[2]
        results = []
        for done in self.core.finished():
            results.append(
                job_result(
                    job_id=done.job_id,
                    success=done.success,
                    successful_keys=done.loaded_keys,
                    transfer_time=done.transfer_s,
                    transfer_bytes=done.transfer_bytes,
                )
            )
        return results

    def has_pending_work(self) -> bool:
        return self.core.pending()

    def drain_jobs(self) -> None:
        self.core.drain()

    def shutdown(self) -> None:
        self.core.shutdown()
