"""Hosts on one machine: network namespaces joined by veth pairs to a bridge, for multi-host tests and benchmarks.

A :class:`Network` makes a bridge namespace (``<tag>-br``, holding bridge ``br0``) and, per host, a namespace
``<tag>-<host>`` whose ``eth0`` is one end of a veth pair, the other end a port of the bridge. Hosts get addresses
``10.<a>.<b>.<n>/24``; traffic never leaves the namespaces (the machine's own network is not touched). Processes
run in a host with :meth:`Network.spawn` (``ip netns exec``). Failures to inject:

- :meth:`kill_host`: SIGKILL every process in the host's namespace (a host dying, all at once);
- :meth:`partition` / :meth:`heal`: an nftables table in the host's namespace that drops every packet in and out
  of ``eth0`` (loopback inside the host still works), then removed;
- :meth:`limit` / :meth:`unlimit`: ``tc`` token-bucket filters (``tbf rate``) on both directions of the host's link,
  and ``netem delay`` where the kernel has it (:func:`has_netem`).

:meth:`Network.close` (also on ``with`` exit, and on any failure while building) kills every process left in the
namespaces and deletes them, which removes their veths, bridge, nftables tables and qdiscs with them.
Needs root and network namespaces (:func:`netns_unavailable` says why not, or None).

:class:`NetCluster` builds a whole kvtier cluster on such hosts: etcd members, ``kvstore init --etcd``,
``kvstore serve --host-id`` on every storage host, and a client driver (``dev/netns_driver.py``) on every
client host (tests/test_multihost.py, benchmarks/multihost_bench.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

IP = "ip"


def _run(argv: Sequence[str], check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, input=stdin)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def netns_unavailable() -> str | None:
    """Why this machine cannot run namespaced hosts (not root, no ``ip``/``nft``/``tc``, no kernel support), or
    None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "tc"):
        if not any(Path(d, tool).exists() for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin")):
            return f"`{tool}` is not installed (Debian: iproute2, nftables)"
    probe = f"kvtprobe{os.getpid() % 100000}"
    done = _run([IP, "netns", "add", probe], check=False)
    if done.returncode != 0:
        return f"this kernel cannot make network namespaces: {done.stderr.strip()}"
    try:
        veth = _run([IP, "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0"], check=False)
        if veth.returncode != 0:
            return f"this kernel cannot make veth pairs: {veth.stderr.strip()}"
    finally:
        _run([IP, "netns", "del", probe], check=False)
    return None


def has_netem() -> bool:
    """Whether ``tc qdisc ... netem`` (added delay) works in this kernel."""
    probe = f"kvtnetem{os.getpid() % 100000}"
    _run([IP, "netns", "add", probe])
    try:
        netem = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        done = _run([IP, "netns", "exec", probe, *netem], check=False)
        return done.returncode == 0
    finally:
        _run([IP, "netns", "del", probe], check=False)


class Network:
    """Hosts joined by a bridge (see the module docstring)."""

    def __init__(self, hosts: Sequence[str], tag: str | None = None, subnet: int = 77) -> None:
        self.tag = tag or f"kvt{os.getpid() % 100000}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = list(hosts)
        self.addresses = {h: f"10.{subnet}.{os.getpid() % 250}.{10 + i}" for i, h in enumerate(self.hosts)}
        self.procs: dict[str, list[subprocess.Popen[Any]]] = {h: [] for h in self.hosts}
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def _build(self) -> None:
        _run([IP, "netns", "add", self.bridge_ns])
        self._made.append(self.bridge_ns)
        br = [IP, "-n", self.bridge_ns]
        _run([*br, "link", "add", "br0", "type", "bridge"])
        _run([*br, "link", "set", "br0", "up"])
        _run([*br, "link", "set", "lo", "up"])
        for i, host in enumerate(self.hosts):
            ns = self.ns(host)
            _run([IP, "netns", "add", ns])
            self._made.append(ns)
            port = f"p{i}"
            _run([*br, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run([*br, "link", "set", port, "master", "br0"])
            _run([*br, "link", "set", port, "up"])
            inside = [IP, "-n", ns]
            _run([*inside, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0"])
            _run([*inside, "link", "set", "eth0", "up"])
            _run([*inside, "link", "set", "lo", "up"])

    def bridge_port(self, host: str) -> str:
        return f"p{self.hosts.index(host)}"

    def spawn(
        self, host: str, argv: Sequence[str], stdin: int | IO[Any] | None = subprocess.DEVNULL, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host`` (its namespace); it is killed with the host or at ``close``."""
        proc = subprocess.Popen([IP, "netns", "exec", self.ns(host), *argv], stdin=stdin, **popen)
        self.procs[host].append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``host`` to completion (stdout and stderr captured as text)."""
        return subprocess.run(
            [IP, "netns", "exec", self.ns(host), *argv], capture_output=True, text=True, timeout=timeout_s
        )

    def pids(self, host: str) -> list[int]:
        done = _run([IP, "netns", "pids", self.ns(host)], check=False)
        return [int(p) for p in done.stdout.split()]

    def kill_host(self, host: str) -> None:
        """SIGKILL every process in ``host``, at once, and reap the ones this Network started."""
        for _ in range(3):  # a process forked while the first were killed is caught by the next round
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for proc in self.procs[host]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self.procs[host] = [p for p in self.procs[host] if p.poll() is None]

    def partition(self, host: str) -> None:
        """Drop every packet into and out of ``host``'s link (nftables in its namespace)."""
        rules = (
            "table inet kvtpart {\n"
            '  chain in { type filter hook input priority -300; policy accept; iifname "eth0" drop; }\n'
            '  chain out { type filter hook output priority -300; policy accept; oifname "eth0" drop; }\n'
            "}\n"
        )
        _run([IP, "netns", "exec", self.ns(host), "nft", "-f", "-"], stdin=rules)

    def heal(self, host: str) -> None:
        _run([IP, "netns", "exec", self.ns(host), "nft", "delete", "table", "inet", "kvtpart"], check=False)

    def limit(self, host: str, rate: str, delay: str | None = None) -> None:
        """Limit ``host``'s link to ``rate`` (tc syntax: ``10gbit``, ``20mbit``) each way; add ``delay`` (``100us``)
        with netem where the kernel has it (ValueError where it does not)."""
        if delay is not None and not has_netem():
            raise ValueError("this kernel has no netem: a link delay cannot be added")
        for ns, dev in ((self.ns(host), "eth0"), (self.bridge_ns, self.bridge_port(host))):
            tc = [IP, "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root"]
            if delay is not None:
                _run([*tc, "handle", "1:", "netem", "delay", delay])
                tc = [IP, "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:"]
            _run([*tc, "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"])

    def unlimit(self, host: str) -> None:
        for ns, dev in ((self.ns(host), "eth0"), (self.bridge_ns, self.bridge_port(host))):
            _run([IP, "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)

    def close(self) -> None:
        """Kill every process in the namespaces and delete them (veths, bridge, rules and qdiscs go with them)."""
        for host in self.hosts:
            if self.ns(host) in self._made:
                self.kill_host(host)
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(5)
        for ns in reversed(self._made):
            _run([IP, "netns", "del", ns], check=False)
        self._made.clear()

    def start_etcd(self, hosts: Sequence[str], workdir: Path) -> str:
        """A 3-member (or ``len(hosts)``) etcd cluster, one member per host, with auto-compaction (keep the last
        1,000 revisions); returns the client endpoints (``a:2379,b:2379,...``) once every member serves."""
        peers = ",".join(f"{h}=http://{self.addresses[h]}:2380" for h in hosts)
        for host in hosts:
            address = self.addresses[host]
            log = open(workdir / f"etcd-{host}.log", "ab")  # noqa: SIM115 - the child holds it
            self.spawn(
                host,
                [
                    "etcd",
                    f"--name={host}",
                    f"--data-dir={workdir / f'etcd-{host}'}",
                    f"--listen-client-urls=http://{address}:2379",
                    f"--advertise-client-urls=http://{address}:2379",
                    f"--listen-peer-urls=http://{address}:2380",
                    f"--initial-advertise-peer-urls=http://{address}:2380",
                    f"--initial-cluster={peers}",
                    f"--initial-cluster-token={self.tag}",
                    "--initial-cluster-state=new",
                    "--auto-compaction-mode=revision",
                    "--auto-compaction-retention=1000",
                ],
                stdout=log,
                stderr=log,
            )
            log.close()
        endpoints = ",".join(f"{self.addresses[h]}:2379" for h in hosts)
        deadline = time.monotonic() + 60
        for host in hosts:
            url = f"http://{self.addresses[host]}:2379/health"
            check = (
                f"import json, urllib.request as u\nassert json.load(u.urlopen({url!r}, timeout=1))['health'] == 'true'"
            )
            while self.run(host, [sys.executable, "-c", check], timeout_s=10).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd on {host} did not become healthy; see {workdir}/etcd-{host}.log")
                time.sleep(0.2)
        return endpoints

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


BIN = Path(sys.executable).parent


class Remote:
    """A client driver process (``dev/netns_driver.py``) on a client host: JSON commands and answers."""

    def __init__(self, net: Network, host: str, config: Path) -> None:
        self.proc = net.spawn(
            host,
            [sys.executable, str(Path(__file__).with_name("netns_driver.py")), str(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        ready = self.stdout.readline()
        if json.loads(ready or "{}") != {"ready": True}:
            raise RuntimeError(f"the client driver on {host} did not start")

    def send(self, op: str, **args: Any) -> None:
        """Start a command; ``receive`` its answer (the driver runs one command at a time)."""
        self.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.stdin.flush()

    def receive(self) -> dict[str, Any]:
        answer = json.loads(self.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"the client driver failed: {answer['error']}")
        return answer  # type: ignore[no-any-return]

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.receive()


class NetCluster:
    """A kvtier cluster on namespaced hosts: ``storage`` hosts with ``nodes_per_host`` nodes each, ``spare`` hosts
    started empty (``kvstore serve`` there waits for nodes the map moves to them), a 3-member etcd on ``etcd``
    hosts, and a client driver on each ``clients`` host. The cluster file is ``work/conf/cluster.toml``."""

    def __init__(
        self,
        net: Network,
        work: Path,
        storage: Sequence[str],
        etcd: Sequence[str],
        clients: Sequence[str],
        spare: Sequence[str] = (),
        nodes_per_host: int = 2,
        lease_ttl_s: float = 3.0,
        capacity: str = "64MiB",
    ) -> None:
        self.net = net
        self.work = work
        self.endpoints = net.start_etcd(etcd, work)
        self.config = work / "conf" / "cluster.toml"
        hosts = ",".join(f"{h}={net.addresses[h]}" for h in storage)
        self.kvstore(
            "init", str(work / "conf"), "--etcd", self.endpoints, "--name", "mh", "--hosts", hosts,
            "--nodes-per-host", str(nodes_per_host), "--capacity", capacity, "--data-root", str(work / "data"),
            "--lease-ttl", str(lease_ttl_s),
        )  # fmt: skip
        self.serving: dict[str, subprocess.Popen[Any]] = {}
        for host in [*storage, *spare]:
            self.serve(host)
        self.drivers = {c: Remote(net, c, self.config) for c in clients}
        self.wait_map(lambda m: all(s == "up" for s in m["states"].values()), 90, "every node up")

    def kvstore(self, *args: str, host: str | None = None) -> str:
        done = self.net.run(host or next(iter(self.net.hosts)), [str(BIN / "kvstore"), *args])
        if done.returncode != 0:
            raise RuntimeError(f"kvstore {args[0]} failed: {done.stderr.strip()}")
        return done.stdout

    def kvctl(self, *args: str, host: str | None = None) -> subprocess.CompletedProcess[str]:
        where = host or next(iter(self.drivers))
        return self.net.run(where, [str(BIN / "kvctl"), "--config", str(self.config), *args], timeout_s=120)

    def serve(self, host: str) -> None:
        log = open(self.work / f"serve-{host}.log", "ab")  # noqa: SIM115 - the child holds it
        self.serving[host] = self.net.spawn(
            host, [str(BIN / "kvstore"), "serve", str(self.config), "--host-id", host], stdout=log, stderr=log
        )
        log.close()

    def map(self) -> dict[str, Any]:
        """The map as the first client host's driver sees it."""
        return next(iter(self.drivers.values())).ask("map")

    def wait_map(self, condition: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> float:
        """Seconds until the map satisfies ``condition``; TimeoutError naming ``what`` after ``timeout_s``."""
        started = time.monotonic()
        while not condition(self.map()):
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{what} did not happen within {timeout_s:g} s; map: {self.map()}")
            time.sleep(0.05)
        return time.monotonic() - started

    def nodes_on(self, host: str) -> list[str]:
        return [nid for nid, h in self.map()["hosts"].items() if h == host]
