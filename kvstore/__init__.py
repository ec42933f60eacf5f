"""Block store: keys and hash chains, EC codec, wire protocol, storage node, chunk engine, placement, client."""

from kvtier.kvstore.client import AsyncClient, CapacityError, Client, connect, connect_async
from kvtier.kvstore.transport import AuthError

__all__ = ["AsyncClient", "AuthError", "CapacityError", "Client", "connect", "connect_async"]
