"""Admission rules without sockets (a clock passed in), and the accept loop under a real descriptor limit."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from kvtier.kvstore.admission import Admission, LogLimiter, Refused
from kvtier.kvstore.protocol import Limits

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


def test_unauthenticated_connections_take_at_most_their_share_and_the_rest_is_kept_for_clients() -> None:
    admission = Admission(LIMITS)
    waiting = [admission.admit(f"10.0.0.{i}") for i in range(4)]
    with pytest.raises(Refused, match="waiting to authenticate"):
        admission.admit("10.0.0.9")
    admission.authenticated(waiting[0])  # its slot is now an authenticated one: a pre-auth slot is free
    clients = [admission.admit("10.0.0.9")]
    admission.authenticated(clients[0])
    clients.append(admission.admit("10.0.0.8"))
    with pytest.raises(Refused, match="too many connections"):
        admission.admit("10.0.0.7")
    admission.release(waiting[1])
    admission.release(waiting[1])  # (twice: released once)
    assert admission.stats()["connections"] == 5 and admission.stats()["pre_auth_connections"] == 3


def test_one_address_waits_to_authenticate_on_at_most_its_own_number_of_connections() -> None:
    admission = Admission(LIMITS)
    first = [admission.admit("10.0.0.1") for _ in range(2)]
    with pytest.raises(Refused, match=r"from 10\.0\.0\.1"):
        admission.admit("10.0.0.1")
    admission.admit("10.0.0.2")  # another address is admitted
    admission.authenticated(first[0])
    admission.admit("10.0.0.1")


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
    admission.authenticated(admission.admit("10.0.0.1"))  # a good token is never refused for its address


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
    from kvtier.kvstore.admission import Acceptor

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
