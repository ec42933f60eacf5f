"""Per-node GC worker: TTL expiry, watermark LRU eviction, zombie-write cleanup, repair."""
