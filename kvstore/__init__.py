"""Block store, in rooms whose imports go one way (docs/design.md, "The store's rooms"):

- the base, here: block keys and hash chains (``keys``), the RS(10,2) codec (``codec``), placement, units, logs,
  and the compiled loops (``_native``, ``_shard_index``); it imports no room;
- ``wire``: how processes talk (frames, batches as fields, sockets, the client transport, admission, the metrics
  endpoint);
- ``cluster``: the cluster file, its map in etcd, membership, running nodes on this host, the ``kvstore`` command;
- ``node`` (a storage node: server and chunk engine) and ``client``, side by side: neither imports the other.

The client is this package's API: :func:`connect`, :class:`Client`, :class:`AsyncClient`.
"""

from kvtier.kvstore import _moved
from kvtier.kvstore.client import AsyncClient, CapacityError, Client, connect, connect_async
from kvtier.kvstore.wire.transport import AuthError

_moved.install()

__all__ = ["AsyncClient", "AuthError", "CapacityError", "Client", "connect", "connect_async"]
