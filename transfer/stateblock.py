"""SWA StateBlocks: a host's shared-memory pool of them, its pull server, and pulls from other hosts.

A StateBlock is one sequence's sliding-window state at a position that is a multiple of 128, keyed by the block
key of the prefix it ends; its size is fixed by the model (:func:`stateblock_bytes`). StateBlocks never go to the
storage cluster. Each engine host keeps them in a slot pool (:class:`~kvtier.transfer.staging.StagingPool`,
LRU; an anonymous memory file only this process maps), tells the directory (:mod:`~kvtier.transfer.directory`)
what it holds, and serves them over TCP on an address of their own. Another host asks the directory where a
key is, then pulls it naming slot and generation: it gets those bytes, or a miss if the slot was reused since
(never another block's bytes: the slot is pinned while it is sent, and only if it still holds that key at that
generation).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.wire.protocol import ErrorCode, Frame, Op, ProtocolError, encode_head
from kvtier.kvstore.wire.sockio import sendmsg_all
from kvtier.transfer import state_protocol as sp
from kvtier.transfer.availability import Availability
from kvtier.transfer.conn import FrameConn, PeerError, serve_connections, tcp
from kvtier.transfer.directory import DirectoryClient, DirectoryError
from kvtier.transfer.staging import PoolError, StagingPool, tenant_id
from kvtier.transfer.state_protocol import Location, StateOp

log = logging.getLogger("kvtier.stateblock")


def stateblock_bytes(n_swa_layers: int, bytes_per_token: int, window: int = 128) -> int:
    """Size of one StateBlock: ``n_swa_layers × (window + 6) × bytes_per_token`` (DeepSeek's: 1,415,040 B)."""
    return n_swa_layers * (window + 6) * bytes_per_token


class Puller:
    """Blocking pulls from other hosts' StateBlock servers, one connection per host kept open."""

    def __init__(self, token: str, timeout_s: float = 5.0) -> None:
        self.token = token
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, int], FrameConn] = {}

    def pull_into(self, location: Location, key: bytes, out: memoryview) -> bool:
        """Receive the StateBlock ``key`` at ``location`` straight into ``out`` (exactly its size).

        False for a miss: the host no longer holds it at that generation, it has another size, or the host
        cannot be reached. Raises AuthError if the host refuses this token.
        """
        conn = self._conns.get(location.addr)
        if conn is None:
            where = f"the StateBlock server at {location.addr[0]}:{location.addr[1]}"
            conn = FrameConn(tcp(location.addr, self.timeout_s), self.token, where, idempotent=True)
            self._conns[location.addr] = conn
        target = [memoryview(out).cast("B")]

        def sink(head: Frame) -> list[memoryview] | None:
            return target if head.payload_len == len(target[0]) else None

        try:
            reply = conn.call(StateOp.PULL, sp.pull_meta(key, location.slot, location.generation), sink=sink)
        except PeerError as exc:
            log.warning("pull failed: %s", exc)
            return False
        return bool(reply.meta.get("found")) and reply.payload_len == len(target[0]) and reply.payload is None

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


class StateBlockHost:
    """This host's StateBlocks: ``put`` and ``get_into`` (local pool first, then a pull from the holder).

    - ``put(key, data)`` copies ``data`` (exactly ``block_bytes``) into a slot, evicting the least recently used
      StateBlock if needed, and registers it with the directory (if it is reachable; otherwise the next heartbeat
      that reaches it re-reports everything). Returns False only when every slot is pinned by pulls in progress.
    - ``get_into(key, out)`` → True with ``out`` filled, or False (a miss: nobody holds it, the holder reused
      the slot, or the holder is unreachable). Misses are never exceptions.
    - A thread heartbeats the directory every ``heartbeat_s``; when the directory does not know this host
      (it restarted, or the lease ran out) the host re-reports all it holds. A directory that stops answering is
      logged once, and once again when it answers again (``directory_availability`` counts both).
    - ``close`` stops serving and frees the pool. The pool is this process's memory: no other process can open it,
      and it goes with the process (a host that crashed starts again with none).
    """

    def __init__(
        self,
        config: cluster_mod.ClusterConfig,
        shm: str,
        capacity_bytes: int,
        block_bytes: int,
        host_id: str,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        directory: tuple[str, int] | None = None,
        token: str | None = None,
        heartbeat_s: float = 2.0,
    ) -> None:
        self.config = config
        self.token = token or config.token
        tenant = config.tenant_for_token(self.token)
        if tenant is None:
            raise PoolError("the token given for the StateBlock host is not one of the cluster file's tokens")
        self.tid = tenant_id(tenant)
        self.block_bytes = block_bytes
        self.host_id = host_id
        self.pool = StagingPool.create(shm, capacity_bytes, block_bytes)
        self.pool.on_evict = self._evicted
        self._evictions: list[tuple[bytes, int, int]] = []
        self._write_lock = threading.Lock()
        self._dir_lock = threading.Lock()
        self.directory = DirectoryClient(directory, self.token) if directory is not None else None
        where = f"the StateBlock directory at {directory[0]}:{directory[1]}" if directory is not None else ""
        self.directory_availability = Availability(where, "StateBlocks of other hosts are not found", log)
        self._reported = False
        self.puller = Puller(self.token)
        try:
            self.listener = socket.create_server(listen)
        except OSError:
            self.pool.close()
            raise
        self.addr: tuple[str, int] = self.listener.getsockname()[:2]
        self._stopping = threading.Event()
        self.heartbeat_s = heartbeat_s
        self.heartbeat()  # the first report: this host's address
        self._threads = [
            threading.Thread(
                target=serve_connections,
                args=(self.listener, config, sp.PULL_REQUESTS, self._serve, self._stopping, log),
                daemon=True,
            ),
            threading.Thread(target=self._heartbeats, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- local pool ------------------------------------------------------------------------------------

    def put(self, key: bytes, data: memoryview | bytes) -> bool:
        view = memoryview(data).cast("B")
        if len(view) != self.block_bytes:
            raise ValueError(f"a StateBlock is {self.block_bytes} bytes here, got {len(view)}")
        with self._write_lock:
            reserved = self.pool.reserve(0)
            if reserved is None:
                return False
            slot, gen = reserved
            self.pool.view(slot, self.block_bytes)[:] = view
            self.pool.publish(slot, self.tid, key, self.block_bytes, None, 0)
        self._report([key], [slot], [gen])
        return True

    def get_into(self, key: bytes, out: memoryview | bytearray) -> bool:
        target = memoryview(out).cast("B")
        if len(target) != self.block_bytes:
            return False
        if self._copy_local(key, target):
            return True
        locations = self.locate([key])
        location = locations[0]
        if location is None or location.addr == self.addr:
            return False
        return self.puller.pull_into(location, key, target)

    def _copy_local(self, key: bytes, out: memoryview) -> bool:
        slot = self.pool.lookup(self.tid, key, length=self.block_bytes)
        if slot is None:
            return False
        gen = int(self.pool.gen[slot])
        if not self.pool.pin(slot, gen, self.tid, key):
            return False
        try:
            out[:] = self.pool.view(slot, self.block_bytes)
        finally:
            self.pool.unpin(slot, gen)
        return True

    def locate(self, keys: Sequence[bytes]) -> list[Location | None]:
        """Where the directory says each key's StateBlock is (batched; all None without a directory)."""
        if self.directory is None:
            return [None] * len(keys)
        try:
            with self._dir_lock:
                found = self.directory.lookup(list(keys))
        except DirectoryError as exc:
            self.directory_availability.failed(exc)
            return [None] * len(keys)
        self.directory_availability.answered()
        return found

    # -- directory -------------------------------------------------------------------------------------

    def _evicted(self, tenant: int, key: bytes, slot: int, gen: int) -> None:
        self._evictions.append((key, slot, gen))

    def _report(self, keys: list[bytes], slots: list[int], gens: list[int]) -> None:
        """Tell the directory about new StateBlocks while it is reachable. While it is not, puts do not wait for
        it: the heartbeat thread keeps trying and re-reports everything once it gets through."""
        if self.directory is None or not self._reported:
            return
        with self._dir_lock:
            try:
                if not self.directory.register(self.host_id, self.addr, keys, slots, gens, full=False):
                    self._register_all()  # the directory restarted or our lease ran out: report everything
                self._flush_evictions()
            except DirectoryError as exc:
                self._reported = False
                self.directory_availability.failed(exc)

    def _register_all(self) -> None:
        assert self.directory is not None
        held = [(k, s, g) for t, k, s, g in self.pool.cached() if t == self.tid]
        self.directory.register(
            self.host_id, self.addr, [h[0] for h in held], [h[1] for h in held], [h[2] for h in held], full=True
        )
        self._reported = True

    def _flush_evictions(self) -> None:
        assert self.directory is not None
        gone, self._evictions = self._evictions, []
        if gone:
            self.directory.unregister(self.host_id, [g[0] for g in gone], [g[1] for g in gone], [g[2] for g in gone])

    def _heartbeats(self) -> None:
        while not self._stopping.wait(self.heartbeat_s):
            self.heartbeat()

    def heartbeat(self) -> bool:
        """Renew the lease now (re-reporting everything if the directory forgot this host); False if it is down."""
        if self.directory is None:
            return False
        with self._dir_lock:
            try:
                if not (self._reported and self.directory.heartbeat(self.host_id)):
                    self._register_all()
                self._flush_evictions()
            except DirectoryError as exc:
                self._reported = False
                self.directory_availability.failed(exc)
                return False
        self.directory_availability.answered()
        return True

    # -- pull server -----------------------------------------------------------------------------------

    def _serve(self, tenant: str, frame: Frame, sock: socket.socket) -> None:
        if frame.opcode != StateOp.PULL:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown opcode {frame.opcode}")
        if self._stopping.is_set():
            raise ProtocolError(ErrorCode.BUSY, "this host is shutting down")
        key, slot, gen = sp.parse_pull(frame.meta)
        reply = Op.REPLY | StateOp.PULL
        if not self.pool.pin(slot, gen, tenant_id(tenant), key):
            sock.sendall(encode_head(reply, frame.request_id, {"found": False}))
            return
        try:
            head = encode_head(reply, frame.request_id, {"found": True}, self.block_bytes)
            sendmsg_all(sock, [head, self.pool.view(slot, self.block_bytes)])
        finally:
            self.pool.unpin(slot, gen)

    def close(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(5)
        self.listener.close()
        self.puller.close()
        if self.directory is not None:
            self.directory.close()
        self.pool.close()

    def __enter__(self) -> StateBlockHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
