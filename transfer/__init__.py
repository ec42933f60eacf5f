"""Transfer tiers: host shared-memory staging pool, fetcher process, swap-in to HBM, SWA StateBlocks.

API for engines (the contracts in full are in each class's docstring and in ``docs/transfer.md``)::

    from kvtier.transfer import FetchClient, FetcherError

    fc = FetchClient("/run/kvtier/fetch.sock", token)      # token: the cluster or a tenant token
    with fc.fetch(keys, block_bytes, headers=None, priority=0) as blocks:   # one Block per key
        for b in blocks:
            b.status     # HIT (host pool), FETCHED (store → slot), MISS, FULL (no free slot), ERROR
            b.ok         # HIT, FETCHED or ALLOCATED: b.slot / b.generation name the slot, pinned until release
            b.array()    # numpy uint8 view of the slot's bytes (no copy, read-only); b.tensor(): torch view
            b.valid()    # the slot still holds this block (False once reused after a fetcher crash)
        blocks.status, blocks.slots, blocks.generations, blocks.ok(), blocks.valid()   # the same, as arrays
        blocks.segment   # the mapping the slots are in: .buffer, .stride, .slots, .data_offset
    # leaving the ``with`` releases the pins (or call fc.release(blocks))
    fc.prefetch(keys, block_bytes)          # same path at low priority, nothing pinned; answered when done
    out = fc.alloc(n, block_bytes)          # writable slots of this tenant's outbox: write into out[i].array() ...
    fc.put(keys, out, ttl_class="chatbot")  # ... then the fetcher copies them into its cache and stores them
    fc.stats()                              # this tenant's pool usage, hit ratio, in-flight
    AsyncFetchClient: the same calls as coroutines; several requests in flight on one connection.

Contracts in one paragraph: a miss is an answer, never an exception. A slot handed out as ``ok`` is pinned
for this connection until released, so the fetcher never reuses it; a connection that closes (the engine
died) releases its pins. A tenant maps only its own segments, the cached ones read-only (sealed: no mapping of
them can be made writable). If the fetcher dies, every outstanding call raises :class:`FetcherError`; the next
call reconnects (a call that finds its connection dead is sent again once, so a restart costs no call); views
already handed out stay mapped, and ``Block.valid()`` says whether their slot still holds the block (a reused
slot has a new generation: a miss, never another block's bytes).

StateBlocks (SWA state, never stored in the cluster)::

    size = stateblock_bytes(n_swa_layers, bytes_per_token)            # × (128 + 6) positions
    host = StateBlockHost(config, "kvt-sb-gpu3", capacity_bytes, size, host_id="gpu-3",
                          listen=("10.0.1.5", 0), directory=("10.0.0.2", 7400), token=token)
    host.put(key, state_bytes) -> bool      # into this host's shm pool (LRU) and registered in the directory
    host.get_into(key, out) -> bool         # local pool, else directory lookup + TCP pull; False: a miss
"""

from kvtier.transfer.conn import PeerError
from kvtier.transfer.fetch_client import AsyncFetchClient, Block, Blocks, FetchClient, FetcherError
from kvtier.transfer.fetch_protocol import BlockStatus
from kvtier.transfer.stateblock import StateBlockHost, stateblock_bytes

__all__ = [
    "AsyncFetchClient",
    "Block",
    "BlockStatus",
    "Blocks",
    "FetchClient",
    "FetcherError",
    "PeerError",
    "StateBlockHost",
    "stateblock_bytes",
]
