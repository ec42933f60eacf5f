"""Transfer tiers: host shared-memory staging pool, fetcher process, swap-in to HBM, SWA StateBlocks."""
