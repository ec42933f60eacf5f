"""kvtier across hosts: ``kvbench putget`` from a client host to 12 nodes on 6 storage hosts (network namespaces on
this machine, every host's link limited with ``tc``), as ratios to one raw TCP stream over the same veths, and the
membership figures: a host's death to "marked down", a partition's heal to serving, a map change to every client.

    python benchmarks/multihost_bench.py [--rate 10gbit] [--delay 100us] [--block-size 1MiB] [--duration 5]
                                         [--repeat 3] [--json]

Needs root (network namespaces), etcd, nftables and iproute2 (``make test`` installs them). ``--delay`` needs
netem in the kernel; without it the delay is reported as unavailable and not applied. Benchmarks are never tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.kvstore.units import parse_size

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: dev/ is not in the installed package
from dev.netns import BIN, NetCluster, Network, has_netem, netns_unavailable

STORAGE = [f"h{i}" for i in range(6)]
ETCD = ["e0", "e1", "e2"]
CLIENTS = ["c0", "c1"]

_RECEIVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = memoryview(bytearray(1 << 20)); got = c.recv_into(buf); start = time.perf_counter()
while True:
    n = c.recv_into(buf)
    if not n: break
    got += n
print(got / (time.perf_counter() - start) / 1e9, flush=True)
"""
_SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = bytes(1 << 20); left = int(sys.argv[3])
while left > 0:
    c.sendall(buf[: min(left, len(buf))]); left -= len(buf)
c.close()
"""


def raw_stream(net: Network, sender: str, receiver: str, total: int) -> float:
    """GB/s of one TCP stream of ``total`` bytes from ``sender`` to ``receiver`` over their veths."""
    rx = net.spawn(
        receiver, [sys.executable, "-c", _RECEIVER, net.addresses[receiver]], stdout=subprocess.PIPE, text=True
    )
    port = rx.stdout.readline().strip()  # type: ignore[union-attr]
    net.run(sender, [sys.executable, "-c", _SENDER, net.addresses[receiver], port, str(total)], timeout_s=300)
    return float(rx.stdout.readline())  # type: ignore[union-attr]


def putget(cluster: NetCluster, block_size: str, duration: float) -> dict[str, Any]:
    argv = [
        str(BIN / "kvbench"), "--config", str(cluster.config), "putget", "--block-size", block_size,
        "--duration", str(duration), "--concurrency", "2", "--max-bytes", "1GiB", "--fresh", "--json",
    ]  # fmt: skip
    done = cluster.net.run("c0", argv, timeout_s=600)
    if done.returncode != 0:
        raise RuntimeError(f"kvbench putget failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def membership(cluster: NetCluster, repeat: int) -> dict[str, list[float]]:
    """Seconds, per repetition: a host killed → its nodes marked down at a client; a partition healed → its nodes
    up at a client; a map change committed → seen by every client."""
    c0 = cluster.drivers["c0"]
    out: dict[str, list[float]] = {"death_to_marked_down_s": [], "heal_to_serving_s": [], "map_change_to_all_s": []}
    for r in range(repeat):
        victims = cluster.nodes_on("h1")
        c0.send("await_map", timeout=60, nodes=victims, state="down")
        killed = time.time()
        cluster.net.kill_host("h1")
        out["death_to_marked_down_s"].append(c0.receive()["t"] - killed)
        cluster.serve("h1")  # the host comes back
        cluster.wait_map(lambda m, v=victims: all(m["states"][n] == "up" for n in v), 60, "h1 back")

        victims = cluster.nodes_on("h2")
        cluster.net.partition("h2")
        cluster.wait_map(lambda m, v=victims: all(m["states"][n] == "down" for n in v), 60, "h2 marked down")
        c0.send("await_map", timeout=60, nodes=victims, state="up")
        healed = time.time()
        cluster.net.heal("h2")
        out["heal_to_serving_s"].append(c0.receive()["t"] - healed)

        edit = c0.ask("edit_ttl", name="bench", seconds=3600.0 + r)
        seen = [d.ask("await_map", timeout=30, revision=edit["revision"])["t"] for d in cluster.drivers.values()]
        out["map_change_to_all_s"].append(max(seen) - edit["t"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="10gbit", help="every host's link, each way (tc tbf)")
    parser.add_argument("--delay", default="100us", help="added per direction with netem, where the kernel has it")
    parser.add_argument("--block-size", default="1MiB")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3, help="membership measurements")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    why = netns_unavailable()
    if why is not None:
        print(f"multihost_bench: {why}", file=sys.stderr)
        return 2
    delay = args.delay if args.delay and has_netem() else None
    with tempfile.TemporaryDirectory() as tmp, Network([*STORAGE, *ETCD, *CLIENTS]) as net:
        cluster = NetCluster(net, Path(tmp), STORAGE, ETCD, CLIENTS, capacity="512MiB")
        for host in [*STORAGE, *CLIENTS]:
            net.limit(host, args.rate, delay)
        total = 8 * parse_size(args.block_size) * 64
        raw = {
            "put_direction_gbps": raw_stream(net, "c0", "h0", total),
            "get_direction_gbps": raw_stream(net, "h0", "c0", total),
        }
        bench = putget(cluster, args.block_size, args.duration)
        kv = bench["kvtier"]
        result = {
            "settings": {"rate": args.rate, "delay": delay or f"none (netem unavailable; asked {args.delay})",
                         "block_size": args.block_size, "hosts": len(STORAGE), "nodes": 12},
            "raw_stream": raw,
            "put_gbps": kv["put"]["gbps"],
            "get_gbps": kv["get"]["gbps"],
            "put_ratio_to_raw": kv["put"]["gbps"] / raw["put_direction_gbps"],
            "get_ratio_to_raw": kv["get"]["gbps"] / raw["get_direction_gbps"],
            "put_p50_ms": kv["put"]["latency_ms"]["p50"],
            "get_p50_ms": kv["get"]["latency_ms"]["p50"],
            "membership": membership(cluster, args.repeat),
        }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"links: {args.rate}, delay {result['settings']['delay']}; raw stream put/get {raw['put_direction_gbps']:.2f}"
          f" / {raw['get_direction_gbps']:.2f} GB/s")  # fmt: skip
    print(f"kvbench putget {args.block_size}: put {result['put_gbps']:.2f} GB/s ({result['put_ratio_to_raw']:.2f}x),"
          f" get {result['get_gbps']:.2f} GB/s ({result['get_ratio_to_raw']:.2f}x)")  # fmt: skip
    for name, values in result["membership"].items():
        print(f"{name}: median {statistics.median(values):.2f} s, all {', '.join(f'{v:.2f}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
