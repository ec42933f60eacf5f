"""A storage node: the server (``server``: one process serving one data dir over TCP; ``metrics``: what it reports)
and its chunk engine (``chunks``), whose parts each keep one thing: shards in size-class slab files (``slabs``)
within the disk's budget (``disk``), shard records by name (``shard_index``) and deleted slots (``dead_slots``),
block records in commit order (``block_table``) and by recency (``lru``), writes in flight charged to their
primary (``charges``), shards whose primary has not confirmed their block (``unconfirmed``), tenants' quotas
(``quotas``), removals under way (``removals``), repairs owed (``owed``), and what a rebuilding peer asks for
(``held_blocks``). Imports the base, ``wire`` and ``cluster``; never the client.

``kvtier.kvstore.node`` was the server (now ``node.server``): its names still resolve here, with a warning, for
one release.
"""

from kvtier.kvstore._moved import forward

__getattr__ = forward("node")
