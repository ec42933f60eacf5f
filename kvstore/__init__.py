"""Block store: keys and hash chains, EC codec, wire protocol, storage node, chunk engine, placement, client."""
