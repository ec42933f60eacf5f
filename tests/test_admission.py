"""Admission rules without sockets (a clock passed in), and the accept loop under a real descriptor limit."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from kvtier.kvstore.wire.admission import Admission, LogLimiter, Refused
from kvtier.kvstore.wire.protocol import Limits

LIMITS = Limits(
    max_connections=6,
    max_pre_auth_connections=4,
    max_pre_auth_per_peer=2,
    hello_timeout_s=5.0,
    max_auth_failures_per_peer=3,
    auth_failure_window_s=30.0,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_new_connection_takes_the_place_of_the_oldest_waiting_one_of_the_address_holding_the_most() -> None:
    """Pre-auth slots used to refuse newcomers once full: 16 flooding addresses kept every new client out."""
    admission = Admission(LIMITS)
    closed: list[str] = []
    waiting = [admission.admit(peer, closed.append) for peer in ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3")]
    client = admission.admit("10.0.0.9")  # the slots are full: 10.0.0.1 holds the most, its oldest goes
    assert waiting[0].evicted and not waiting[1].evicted and len(closed) == 1 and "newer" in closed[0]
    admission.authenticated(client, "a")
    with pytest.raises(Refused, match="HELLO at once"):
        admission.authenticated(waiting[0], "a")  # (its HELLO came too late)
    assert admission.stats() == {
        "connections": 4, "pre_auth_connections": 3, "connections_refused": 0, "hello_timeouts": 0,
        "pre_auth_evicted": 1,
    }  # fmt: skip


def test_an_address_at_its_limit_displaces_only_its_own_oldest_waiting_connection() -> None:
    admission = Admission(LIMITS)
    mine = [admission.admit("10.0.0.1") for _ in range(2)]
    other = admission.admit("10.0.0.2")
    admission.admit("10.0.0.1")
    assert mine[0].evicted and not mine[1].evicted and not other.evicted


def test_each_tenant_holds_at_most_its_share_of_the_authenticated_slots_the_admin_aside() -> None:
    admission = Admission(LIMITS, tenants=2)  # (6 - 4) // 2: one authenticated connection a tenant
    admission.authenticated(admission.admit("10.0.0.1"), "a")
    with pytest.raises(Refused, match="'a' holds 1 connections here, its share"):
        admission.authenticated(admission.admit("10.0.0.1"), "a")
    admission.authenticated(admission.admit("10.0.0.1"), "b")  # another tenant is not held back by a
    admission.authenticated(admission.admit("10.0.0.1"), "default", capped=False)


def test_connections_are_refused_only_when_every_slot_is_authenticated() -> None:
    admission = Admission(LIMITS)
    for _ in range(6):
        admission.authenticated(admission.admit("10.0.0.1"), "default", capped=False)
    with pytest.raises(Refused, match="too many connections"):
        admission.admit("10.0.0.2")


def test_failed_hellos_beyond_the_allowance_are_held_back_until_it_refills_by_one() -> None:
    clock = Clock()
    admission = Admission(LIMITS, clock)
    tickets = [admission.admit("10.0.0.1") for _ in range(2)]
    assert [admission.failed(tickets[i % 2]) for i in range(3)] == [0.0, 0.0, 0.0]
    assert admission.failed(tickets[0]) == pytest.approx(10.0 / 2)  # a failure's worth refills in 10 s (max 5 s)
    clock.now += 20.0  # two failures' worth: the allowance is back above one
    assert admission.failed(tickets[0]) == 0.0
    assert admission.failed(admission.admit("10.0.0.2")) == 0.0  # another address has its own
    for ticket in tickets:
        admission.release(ticket)
    admission.authenticated(admission.admit("10.0.0.1"), "a")  # a good token is never refused for its address


def test_a_tickets_deadline_is_the_hello_timeout_after_admission() -> None:
    clock = Clock()
    ticket = Admission(LIMITS, clock).admit("10.0.0.1")
    assert ticket.remaining_s() == 5.0
    clock.now += 4.5
    assert ticket.remaining_s() == pytest.approx(0.5)
    clock.now += 1.0
    assert ticket.remaining_s() == 0.0


def test_a_log_limiter_logs_a_burst_per_period_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limiter = LogLimiter(logging.getLogger("test.limiter"), burst=2, period_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test.limiter"):
        for n in range(5):
            limiter.warning("bad", "bad frame %d", n)
        limiter.warning("other", "another kind")
        clock.now += 10.0
        limiter.warning("bad", "bad frame %d", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "bad frame 0",
        "bad frame 1",
        "another kind",
        "bad frame 5 (3 more like it not logged)",
    ]


ACCEPT_UNDER_A_LIMIT = textwrap.dedent(
    """
    import logging, os, resource, socket
    from kvtier.kvstore.wire.admission import Acceptor

    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    acceptor = Acceptor(listener, logging.getLogger("t"))
    clients = [socket.create_connection(listener.getsockname()) for _ in range(8)]
    in_use = len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    accepted = []
    while (got := acceptor.accept()) is not None or acceptor.dropped + len(accepted) < 8:
        if got is not None:
            accepted.append(got[0])
    closed = 0
    for client in clients:
        client.settimeout(0.5)
        try:
            closed += client.recv(1) == b""
        except TimeoutError:  # the one accepted: open, and silent
            pass
    print(len(accepted), acceptor.dropped, closed)
    """
)


def test_an_acceptor_out_of_descriptors_turns_connections_away_instead_of_failing() -> None:
    done = subprocess.run([sys.executable, "-c", ACCEPT_UNDER_A_LIMIT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    accepted, dropped, closed = map(int, done.stdout.split())
    assert accepted == 1 and dropped == 7  # room for one connection (and the reserve, taken before)
    assert closed == 7  # the turned-away peers see their connection closed, not a hang
