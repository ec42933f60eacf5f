"""Trace replay against a running cluster (``kvbench --config PATH replay TRACE --mode live``).

Same semantics as the simulation (``tools.replay``), but every block really moves: per request, ``match``
finds the leading stored blocks, ``get_into`` reads them (a block evicted between the two ends the hit
there), and the rest are ``put`` with ``bytes_per_token × block_tokens`` bytes each, in the request's TTL
class. Capacity, watermarks and TTLs are the cluster's own (its nodes' GC decides what goes), so the result
is the store's real behaviour under the trace; evictions and expirations are the nodes' GC counters over
the run. Keys are ``blake2b(salt ‖ hash id)`` (``tools.capacity.block_key``): a fresh salt per run keeps runs from
hitting each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from kvtier.kvstore.client import CapacityError, Client
from kvtier.tools.capacity import block_key, cluster_capacity
from kvtier.tools.replay import ReplayResult, replay
from kvtier.tools.traces import DEFAULT_TTL_CLASS, Request


def _gc_totals(client: Client) -> tuple[int, int, int]:
    """Evictions, expirations and primary blocks summed over the nodes that answer."""
    evictions = expirations = blocks = 0
    for info in client.node_info().values():
        if "error" not in info and info.get("gc"):
            evictions += info["gc"]["evictions"]
            expirations += info["gc"]["expirations"]
            blocks += sum(info.get("classes", {}).values())
    return evictions, expirations, blocks


def replay_live(
    requests: list[Request],
    client: Client,
    block_tokens: int,
    bytes_per_token: int,
    progress: Callable[[Iterable[Request]], Iterable[Request]] = iter,
    salt: bytes | None = None,
) -> ReplayResult:
    """Replay ``requests`` through ``client`` (which needs the cluster token, for the GC counters). Keys are
    ``block_key(hash id, salt)``, a fresh random ``salt`` when None. The result's ``capacity_blocks`` is the
    cluster's, for blocks of ``block_tokens × bytes_per_token`` (``tools.capacity``)."""
    if bytes_per_token <= 0:
        raise ValueError("--mode live moves real bytes: give --bytes-per-token, e.g. 64")
    block_bytes = block_tokens * bytes_per_token
    payload = memoryview(os.urandom(block_bytes))
    salt = os.urandom(8) if salt is None else salt
    ideal = replay(requests, block_tokens=block_tokens)  # infinite capacity, no TTL: the upper bound
    evictions0, expirations0, _ = _gc_totals(client)
    input_tokens = hit_tokens = total_blocks = hit_blocks = written = max_stored = 0
    buffers: list[bytearray] = []
    for n, request in enumerate(progress(requests), 1):
        keys = [block_key(h, salt) for h in request.hash_ids]
        hit = client.match(keys)
        while len(buffers) < hit:
            buffers.append(bytearray(block_bytes))
        found = client.get_into(keys[:hit], buffers[:hit]) if hit else []
        hit = next((i for i, ok in enumerate(found) if not ok), hit)
        try:
            stored = client.put(keys[hit:], [payload] * (len(keys) - hit), request.ttl_class or DEFAULT_TTL_CLASS)
        except CapacityError as exc:
            stored = exc.stored
        written += sum(stored)
        input_tokens += request.input_length
        hit_tokens += min(hit * block_tokens, request.input_length)
        hit_blocks += hit
        total_blocks += len(keys)
        if n % 500 == 0:
            max_stored = max(max_stored, _gc_totals(client)[2])
    evictions1, expirations1, blocks_at_end = _gc_totals(client)
    return ReplayResult.from_counts(
        requests=len(requests),
        input_tokens=input_tokens,
        hit_tokens=hit_tokens,
        ideal_hit_tokens=ideal.hit_tokens,
        total_blocks=total_blocks,
        hit_blocks=hit_blocks,
        written=written,
        block_bytes=block_bytes,
        evictions=evictions1 - evictions0,
        expirations=expirations1 - expirations0,
        capacity_blocks=cluster_capacity(client.config, block_bytes).blocks,
        max_blocks_stored=max(max_stored, blocks_at_end),
        blocks_stored_at_end=blocks_at_end,
    )
