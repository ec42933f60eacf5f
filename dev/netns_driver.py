"""A client on another host (``dev/netns.py``'s ``Remote``): one JSON command per stdin line, one JSON answer a line.

Blocks are numbered; block ``i``'s key and bytes are derived from ``i`` alone, so any host can check any other's.

    {"op": "put", "first": 0, "count": 64, "size": 65536}  -> {"stored": [...], "s": elapsed}
    {"op": "get", "first": 0, "count": 64, "size": 65536}  -> {"hits", "wrong", "missing": [...], "s", "stats"}
    {"op": "probe", "first": 0, "count": 64}                -> {"complete": blocks with all 12 shards}
    {"op": "map"}                                            -> {"revision", "seen", "states", "filling"}
    {"op": "put_for", "seconds": 5, "size": 4096, "first": 10000}  -> puts batches of 8 for that long
    {"op": "edit_ttl", "name": "x", "seconds": 60}           -> {"revision", "t": when committed}
    {"op": "await_map", "timeout": 10, "revision": R, "nodes": ["4"], "state": "down"}  -> {"t": when seen}
    {"op": "fetch", "socket": PATH, "first", "count", "size"}      -> statuses of a fetcher's answers, wrong bytes
    {"op": "sb_put" | "sb_get", "key": HEX, "seed": 1, "directory": "ADDR:PORT", "listen": "ADDR"}
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import numpy as np

from kvtier.kvstore.client import connect

STATE_BLOCK = 16 << 10


def key(i: int) -> bytes:
    return hashlib.blake2b(f"multihost-{i}".encode(), digest_size=16).digest()


def block(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


class Driver:
    def __init__(self, path: str) -> None:
        self.path = path
        self.client = connect(path)
        self.state_host: Any = None

    def put(self, first: int, count: int, size: int) -> dict[str, Any]:
        keys = [key(i) for i in range(first, first + count)]
        started = time.monotonic()
        stored = self.client.put(keys, [block(i, size) for i in range(first, first + count)])
        return {"stored": stored, "s": time.monotonic() - started, "stats": self.client.stats}

    def get(self, first: int, count: int, size: int) -> dict[str, Any]:
        keys = [key(i) for i in range(first, first + count)]
        started = time.monotonic()
        got = self.client.get(keys)
        elapsed = time.monotonic() - started
        missing = [first + b for b, g in enumerate(got) if g is None]
        wrong = sum(1 for b, g in enumerate(got) if g is not None and bytes(g) != block(first + b, size))
        return {
            "hits": count - len(missing),
            "wrong": wrong,
            "missing": missing,
            "s": elapsed,
            "stats": self.client.stats,
        }

    def probe(self, first: int, count: int) -> dict[str, Any]:
        present = self.client.probe([key(i) for i in range(first, first + count)])
        return {"complete": int(present.all(axis=1).sum()), "shards": int(present.sum())}

    def map(self) -> dict[str, Any]:
        self.client.placement  # noqa: B018 - adopts the newest map the feed has
        config = self.client.config
        feed = config.feed
        return {
            "revision": config.revision,
            "seen": list(feed.revisions_seen) if feed is not None else [],
            "states": {str(nid): n.state for nid, n in config.nodes.items()},
            "filling": sorted(nid for nid, n in config.nodes.items() if n.filling),
            "hosts": {str(nid): n.host_id for nid, n in config.nodes.items()},
        }

    def edit_ttl(self, name: str, seconds: float) -> dict[str, Any]:
        """Change a TTL class in the map; the new revision and when it was committed (``time.time()``)."""
        feed = self.client.config.feed
        revision = feed.store.update(lambda doc: doc["ttl"].update({name: seconds}) or True)
        return {"revision": revision, "t": time.time()}

    def await_map(self, timeout: float, revision: int = 0, nodes: list[str] | None = None, state: str = "") -> dict:
        """When (``time.time()``) this client's map reached ``revision``, or gave ``nodes`` that ``state``; polled
        every millisecond (what the client itself would act on at its next call)."""
        feed = self.client.config.feed
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            config = feed.latest()
            states = {str(nid): n.state for nid, n in config.nodes.items()}
            if config.revision >= revision and all(states[n] == state for n in nodes or []):
                return {"t": time.time(), "revision": config.revision}
            time.sleep(0.001)
        raise TimeoutError(f"the map did not get there in {timeout:g} s")

    def put_for(self, seconds: float, size: int, first: int) -> dict[str, Any]:
        deadline = time.monotonic() + seconds
        stored = tried = 0
        i = first
        while time.monotonic() < deadline:
            result = self.put(i, 8, size)
            stored += sum(result["stored"])
            tried += 8
            i += 8
        return {"stored": stored, "tried": tried, "next": i}

    def fetch(self, socket: str, first: int, count: int, size: int) -> dict[str, Any]:
        from kvtier.transfer.fetch_client import FetchClient

        keys = [key(i) for i in range(first, first + count)]
        with FetchClient(socket, self.client.config.token) as fetcher, fetcher.fetch(keys, size) as got:
            statuses = [b.status.name for b in got]
            wrong = sum(
                1
                for b, g in enumerate(got)
                if g.status.name in ("HIT", "FETCHED") and g.array().tobytes() != block(first + b, size)
            )
        return {"statuses": statuses, "wrong": wrong}

    def state_block(self, op: str, cmd: dict[str, Any]) -> dict[str, Any]:
        from kvtier.transfer.stateblock import StateBlockHost

        if self.state_host is None:
            address, port = cmd["directory"].rsplit(":", 1)
            self.state_host = StateBlockHost(
                self.client.config,
                f"kvt-mh-{cmd['name']}",
                4 * STATE_BLOCK,
                STATE_BLOCK,
                cmd["name"],
                directory=(address, int(port)),
                listen=(cmd["listen"], 0),
                heartbeat_s=0.2,
            )
        data = block(cmd["seed"], STATE_BLOCK)
        if op == "sb_put":
            return {"ok": bool(self.state_host.put(bytes.fromhex(cmd["key"]), np.frombuffer(data, dtype=np.uint8)))}
        out = bytearray(STATE_BLOCK)
        hit = bool(self.state_host.get_into(bytes.fromhex(cmd["key"]), out))
        return {"hit": hit, "right": hit and bytes(out) == data}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.pop("op")
        if op in ("sb_put", "sb_get"):
            return self.state_block(op, cmd)
        return getattr(self, op)(**cmd)  # type: ignore[no-any-return]


def main() -> None:
    driver = Driver(sys.argv[1])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            answer = driver.handle(json.loads(line))
        except Exception as exc:  # the test reads the error; the driver keeps serving
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    if driver.state_host is not None:
        driver.state_host.close()
    driver.client.close()
    if driver.client.config.feed is not None:
        driver.client.config.feed.close()


if __name__ == "__main__":
    main()
