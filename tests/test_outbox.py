"""Messages to a peer that falls behind (a coordinator slower than its decode workers' token rate) wait, in
order, instead of being dropped: a dropped TokenBatch would be a silent hole in a client's text. Real ZMQ."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from engine.outbox import Outbox
from engine.protocol import TokenBatch, TokenDelta, decode


class Peers:
    """Peers and outboxes over one ZMQ context, all closed after the test."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.socks, self.outboxes = [], []

    def slow(self):
        """A peer that reads only when the test says, holding at most 5 messages in its queue meanwhile."""
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 5)
        sock.bind("tcp://127.0.0.1:*")
        self.socks.append(sock)
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def outbox(self, **kw) -> Outbox:
        self.outboxes.append(Outbox(self.ctx, **kw))
        return self.outboxes[-1]

    def close(self):
        for out in self.outboxes:
            out.close()
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()


@pytest.fixture
def peers():
    p = Peers()
    yield p
    p.close()


def batch(i: int) -> TokenBatch:
    return TokenBatch("d0", [TokenDelta(f"r{i % 3}", [i])])


def receive_all(sock, out: Outbox, n: int, timeout: float = 10.0) -> list[int]:
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        out.flush()  # the owner's loop
        try:
            got.append(decode(sock.recv(flags=zmq.NOBLOCK)).items[0].token_ids[0])
        except zmq.Again:
            time.sleep(0.001)
    return got


def test_a_peer_that_takes_nothing_for_a_while_gets_every_message_in_order(peers, caplog):
    sock, addr = peers.slow()
    out = peers.outbox(hwm=5)
    with caplog.at_level(logging.WARNING, logger="engine.outbox"):
        assert all(out.send(addr, batch(i)) for i in range(5000))  # the peer reads nothing meanwhile
    assert out.backlog() > 0, "ZMQ's queues (and the kernel's) hold some; the rest waits in the outbox"
    assert sum("not keeping up" in r.message for r in caplog.records) == 1, "said once, not per message"
    assert receive_all(sock, out, 5000) == list(range(5000))
    assert out.backlog() == 0
    # Caught up: sent straight away again.
    out.send(addr, batch(7))
    assert receive_all(sock, out, 1) == [7] and out.backlog() == 0


def test_a_peer_that_takes_nothing_at_all_costs_bounded_memory(peers, caplog):
    out = peers.outbox(hwm=5, max_backlog=50)
    _, addr = peers.slow()
    with caplog.at_level(logging.WARNING, logger="engine.outbox"):
        sent = [out.send(addr, batch(i)) for i in range(20000)]
    assert out.backlog() == 50 and not all(sent)
    assert sum("dropping messages" in r.message for r in caplog.records) == 1
    # Another peer is not held up by it.
    other, other_addr = peers.slow()
    assert out.send(other_addr, batch(1)) and receive_all(other, out, 1) == [1]


def test_sockets_to_peers_unused_for_a_while_are_closed_and_reopened_when_needed(peers):
    out = peers.outbox(idle_close_s=0.2)
    ends = [peers.slow() for _ in range(3)]
    for i, (_, addr) in enumerate(ends):
        out.send(addr, batch(i))
    assert out.peers() == 3
    time.sleep(0.1)
    out.send(ends[0][1], batch(10))  # still in use
    time.sleep(0.15)
    out.flush()
    assert out.peers() == 1, "the two idle ones are closed"
    out.send(ends[1][1], batch(11))
    assert out.peers() == 2
    assert receive_all(ends[1][0], out, 2) == [1, 11], "what was sent before the close arrived"


def test_a_peer_that_takes_nothing_for_the_idle_time_is_given_up_with_what_waits_for_it(peers, caplog):
    """A coordinator that died with requests running: what its workers still send it must not be kept."""
    out = peers.outbox(hwm=5, idle_close_s=0.3)
    sock, addr = peers.slow()
    for i in range(5000):
        out.send(addr, batch(i))
    assert out.backlog() > 0
    sock.close(0)  # it dies (ZMQ drops what its connection held, and queues a few more for a reconnection)
    with caplog.at_level(logging.ERROR, logger="engine.outbox"):
        for _ in range(3):
            time.sleep(0.35)
            out.flush()
    assert out.backlog() == 0 and out.peers() == 0
    assert any("taken for gone" in r.message for r in caplog.records)
