"""The coordinator's placement and failure handling, against workers played by the test over real ZMQ sockets:
every message the dispatcher sends is seen, and every reply is the test's to give."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from coordinator.dispatcher import Dispatcher
from coordinator.registry import MemoryRegistry
from engine.protocol import (Abort, Allocate, Allocated, KVLayout, PeerLeft, Prefill, WorkerInfo, decode,
                             encode)

LAYOUT = KVLayout(2, 16, 2, 32, "float32")


class FakeWorker:
    """A worker's control socket: what the dispatcher sent it, in order."""

    def __init__(self, ctx: zmq.Context, worker_id: str, role: str):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.info = WorkerInfo(worker_id, role, "127.0.0.1", self.sock.getsockopt_string(zmq.LAST_ENDPOINT),
                               "default", LAYOUT, 4096, 4096, transfer={"tcp": b"tcp://127.0.0.1:1"})

    async def next(self, timeout: float = 5.0):
        for _ in range(int(timeout / 0.01)):
            try:
                return decode(self.sock.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                await asyncio.sleep(0.01)
        raise AssertionError(f"{self.info.worker_id} got no message in {timeout} s")

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(decode(self.sock.recv(flags=zmq.NOBLOCK)))
            except zmq.Again:
                return out


@pytest.fixture
def cluster():
    ctx = zmq.Context()
    registry = MemoryRegistry()
    workers = {name: FakeWorker(ctx, name, role) for name, role in
               (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))}
    for w in workers.values():
        registry.put(w.info)
    reply = ctx.socket(zmq.PUSH)
    reply.setsockopt(zmq.LINGER, 0)
    yield registry, workers, reply
    reply.close(0)
    for w in workers.values():
        w.sock.close(0)
    ctx.term()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_burst_of_requests_spreads_over_the_decode_workers(cluster):
    registry, workers, reply = cluster

    async def scenario():
        d = Dispatcher(registry)
        d.refresh()
        await d.start()
        reply.connect(d.addr)
        try:
            # Four requests placed together: each decode worker is asked for two, although neither has answered
            # any Allocate yet (a reservation counts from the moment it is asked for).
            placing = [asyncio.create_task(d.submit([1, 2, 3], {})) for _ in range(4)]
            asked = {"d0": [], "d1": []}
            for name in asked:
                for _ in range(2):
                    msg = await workers[name].next()
                    assert isinstance(msg, Allocate)
                    asked[name].append(msg.rid)
            for name, rids in asked.items():
                for rid in rids:
                    reply.send(encode(Allocated(rid, name, [7], 0)))
            placed = await asyncio.gather(*placing)
            assert sorted(t.decode_id for t in placed) == ["d0", "d0", "d1", "d1"]
        finally:
            await d.stop()

    run(scenario())


def test_a_decode_worker_lost_during_prefill_stops_that_prefill_and_is_announced(cluster):
    registry, workers, reply = cluster

    async def scenario():
        d = Dispatcher(registry)
        d.refresh()
        await d.start()
        reply.connect(d.addr)
        try:
            placing = asyncio.create_task(d.submit(list(range(100)), {}))
            alloc = victim = None
            for _ in range(500):  # one of the two decode workers is asked
                for name in ("d0", "d1"):
                    for msg in workers[name].drain():
                        if isinstance(msg, Allocate):
                            alloc, victim = msg, name
                if alloc is not None:
                    break
                await asyncio.sleep(0.01)
            assert alloc is not None
            reply.send(encode(Allocated(alloc.rid, victim, [3, 4, 5, 6, 7, 8, 9], 0)))
            t = await placing
            assert isinstance(await workers["p0"].next(), Prefill)
            assert d._prefill_inflight["p0"] == 100

            registry.remove(victim)  # the decode worker dies before the first token
            delta = await asyncio.wait_for(t.queue.get(), 5)
            assert delta.error and victim in delta.error
            seen = [await workers["p0"].next() for _ in range(2)]
            assert PeerLeft(victim) in seen, "the others are told who left"
            assert Abort(t.rid) in seen, "the prefill for a dead decode worker is stopped"
            survivor = "d1" if victim == "d0" else "d0"
            assert PeerLeft(victim) in workers[survivor].drain()
            assert d._prefill_inflight["p0"] == 0 and d._decode_inflight[victim] == 0
            d.abort(t.rid)  # the client's handler ends the request: nothing is counted twice
            assert d._prefill_inflight["p0"] == 0 and d._decode_inflight[victim] == 0
        finally:
            await d.stop()

    run(scenario())
