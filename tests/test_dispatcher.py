"""The coordinator's placement and failure handling, against workers played by the test over real ZMQ sockets:
every message the dispatcher sends is seen, and every reply is the test's to give."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
import pytest
import zmq

from coordinator.dispatcher import Dispatcher, PlacementError
from coordinator.registry import MemoryRegistry
from engine.protocol import (Abort, Allocate, Allocated, Heartbeat, Introduce, KVLayout, Lease, LivePeers, PeerLeft,
                             Prefill, TokenBatch, TokenDelta, WorkerInfo, decode, encode)

LAYOUT = KVLayout(2, 16, 2, 32, "float32")


class FakeWorker:
    """A worker's control socket: what the dispatcher sent it, in order (LivePeers and Lease, sent on timers,
    and Introduce, sent as workers appear, apart)."""

    def __init__(self, ctx: zmq.Context, worker_id: str, role: str):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.backlog: list = []  # read by a helper that looked for something else
        self.live_peers: list[LivePeers] = []
        self.leases: list[Lease] = []
        self.introductions: list[Introduce] = []
        self.log: list = []  # every message, in the order it came
        self.info = WorkerInfo(worker_id, role, "127.0.0.1", self.sock.getsockopt_string(zmq.LAST_ENDPOINT),
                               "default", LAYOUT, 4096, 4096, transfer={"tcp": b"tcp://127.0.0.1:1"})

    def _recv(self):
        while True:
            msg = decode(self.sock.recv(flags=zmq.NOBLOCK))
            self.log.append(msg)
            if isinstance(msg, LivePeers):
                self.live_peers.append(msg)
            elif isinstance(msg, Lease):
                self.leases.append(msg)
            elif isinstance(msg, Introduce):
                self.introductions.append(msg)
            else:
                return msg

    async def next(self, timeout: float = 5.0):
        if self.backlog:
            return self.backlog.pop(0)
        for _ in range(int(timeout / 0.01)):
            try:
                return self._recv()
            except zmq.Again:
                await asyncio.sleep(0.01)
        raise AssertionError(f"{self.info.worker_id} got no message in {timeout} s")

    def drain(self) -> list:
        out, self.backlog = self.backlog, []
        while True:
            try:
                out.append(self._recv())
            except zmq.Again:
                return out


@pytest.fixture
def cluster():
    ctx = zmq.Context()
    registry = MemoryRegistry(ttl_s=600)  # the test says when a worker leaves
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


@contextlib.asynccontextmanager
async def started(registry, reply=None, **attrs):
    """A running dispatcher over `registry` (attributes set first, e.g. max_attempts), its replies coming from
    `reply`; stopped on the way out."""
    d = Dispatcher(registry)
    for name, value in attrs.items():
        setattr(d, name, value)
    d.refresh()
    await d.start()
    if reply is not None:
        reply.connect(d.addr)
    try:
        yield d
    finally:
        await d.stop()


def test_a_burst_of_requests_spreads_over_the_decode_workers(cluster):
    registry, workers, reply = cluster

    async def scenario():
        async with started(registry, reply) as d:
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

    run(scenario())


async def allocate_reply(workers, names, reply) -> tuple[Allocate, str]:
    """Wait for the Allocate one of `names` gets, answer it; (the Allocate, who got it)."""
    for _ in range(500):
        for name in names:
            msgs = workers[name].drain()
            for i, msg in enumerate(msgs):
                if isinstance(msg, Allocate):
                    workers[name].backlog = msgs[:i] + msgs[i + 1:]
                    reply.send(encode(Allocated(msg.rid, name, [3, 4, 5, 6, 7, 8, 9], 0)))
                    return msg, name
            workers[name].backlog = msgs
        await asyncio.sleep(0.01)
    raise AssertionError(f"none of {names} was asked to allocate")


def test_a_request_whose_decode_worker_dies_before_its_first_token_is_placed_again(cluster):
    registry, workers, reply = cluster

    async def scenario():
        async with started(registry, reply) as d:
            placing = asyncio.create_task(d.submit(list(range(100)), {}))
            first, victim = await allocate_reply(workers, ["d0", "d1"], reply)
            t = await placing
            assert first.rid == t.rid and await workers["p0"].next() == Prefill(
                t.rid, list(range(100)), {}, d.addr, victim, workers[victim].info.ctrl_addr, "tcp",
                b"tcp://127.0.0.1:1", [3, 4, 5, 6, 7, 8, 9], 0)
            survivor = "d1" if victim == "d0" else "d0"

            registry.remove(victim)  # the decode worker dies while the prompt is in prefill
            second, where = await allocate_reply(workers, [survivor], reply)
            assert second.rid == f"{t.rid}.1", "a new placement, under a new id"
            seen = [await workers["p0"].next() for _ in range(3)]
            assert seen[:2] == [PeerLeft(victim), Abort(t.rid)], "the old prefill is stopped"
            assert isinstance(seen[2], Prefill) and seen[2].rid == second.rid and seen[2].decode_id == survivor
            assert PeerLeft(victim) in workers[survivor].drain()

            # A late error about the abandoned placement does not reach the request; the new one's tokens do.
            reply.send(encode(TokenBatch("p0", [TokenDelta(t.rid, [], error="KV transfer failed")])))
            reply.send(encode(TokenBatch(survivor, [TokenDelta(second.rid, [42])])))
            delta = await asyncio.wait_for(t.queue.get(), 5)
            assert delta.error is None and delta.token_ids == [42]
            assert d._prefill_inflight["p0"] == 0 and d._decode_inflight == {victim: 0, survivor: 1}
            assert d.placed_again == {"before_first_token": 1, "mid_stream": 0}
            reply.send(encode(TokenBatch(survivor, [TokenDelta(second.rid, [43], finish_reason="length")])))
            assert (await asyncio.wait_for(t.queue.get(), 5)).finish_reason == "length"
            d.finish(t.rid)
            assert d._decode_inflight == {victim: 0, survivor: 0} and not d.by_wire and not d.requests

    run(scenario())


def test_a_request_is_placed_at_most_max_attempts_times(cluster):
    registry, workers, reply = cluster
    workers_left = ["d0", "d1"]

    async def scenario():
        async with started(registry, reply, max_attempts=2) as d:
            placing = asyncio.create_task(d.submit([1, 2, 3], {}))
            _, victim = await allocate_reply(workers, workers_left, reply)
            t = await placing
            registry.remove(victim)
            workers_left.remove(victim)
            _, victim = await allocate_reply(workers, workers_left, reply)
            registry.remove(victim)
            delta = await asyncio.wait_for(t.queue.get(), 5)
            assert delta.error and victim in delta.error
            d.abort(t.rid)
            assert d._prefill_inflight["p0"] == 0 and set(d._decode_inflight.values()) == {0}

    run(scenario())


def test_a_request_whose_decode_worker_dies_mid_stream_goes_on_from_its_tokens(cluster):
    registry, workers, reply = cluster

    async def scenario():
        async with started(registry, reply) as d:
            placing = asyncio.create_task(d.submit(list(range(100)), {"max_tokens": 5, "seed": 3}))
            _, victim = await allocate_reply(workers, ["d0", "d1"], reply)
            t = await placing
            survivor = "d1" if victim == "d0" else "d0"
            reply.send(encode(TokenBatch(victim, [TokenDelta(t.rid, [10])])))
            reply.send(encode(TokenBatch(victim, [TokenDelta(t.rid, [11])])))
            assert [(await asyncio.wait_for(t.queue.get(), 5)).token_ids for _ in range(2)] == [[10], [11]]

            registry.remove(victim)
            again, _ = await allocate_reply(workers, [survivor], reply)
            assert again.rid == f"{t.rid}.1" and again.prompt_ids == list(range(100)) + [10, 11]
            assert again.params == {"max_tokens": 3, "seed": 3, "min_tokens": 0, "output_offset": 2}
            msgs = workers["p0"].drain() + [await workers["p0"].next()]
            assert [m for m in msgs if isinstance(m, Prefill)][-1].rid == again.rid
            assert not any(isinstance(m, Abort) for m in msgs), "the old prefill had finished long ago"

            # The new placement's tokens continue the stream; its prefix-cache hits on the request's own
            # earlier tokens are not reported as the client's.
            reply.send(encode(TokenBatch(survivor, [TokenDelta(again.rid, [12], cached_tokens=102)])))
            delta = await asyncio.wait_for(t.queue.get(), 5)
            assert delta.token_ids == [12] and delta.error is None and delta.cached_tokens == 100
            assert d.placed_again == {"before_first_token": 0, "mid_stream": 1}

    run(scenario())


def test_a_request_with_output_penalties_is_not_continued_elsewhere(cluster):
    registry, workers, reply = cluster

    async def scenario():
        async with started(registry, reply) as d:
            placing = asyncio.create_task(d.submit([1, 2, 3], {"frequency_penalty": 0.5}))
            _, victim = await allocate_reply(workers, ["d0", "d1"], reply)
            t = await placing
            reply.send(encode(TokenBatch(victim, [TokenDelta(t.rid, [10])])))
            assert (await asyncio.wait_for(t.queue.get(), 5)).token_ids == [10]
            registry.remove(victim)
            delta = await asyncio.wait_for(t.queue.get(), 5)
            assert delta.error and victim in delta.error

    run(scenario())


def test_workers_hear_which_peers_are_in_the_registry(cluster, monkeypatch):
    """Besides PeerLeft when a worker leaves, every worker is told now and then who is in the registry, so
    that peers it never heard a PeerLeft for (a coordinator restarted meanwhile) can be let go."""
    registry, workers, reply = cluster
    monkeypatch.setattr(Dispatcher, "live_peers_first_s", 0.3)
    monkeypatch.setattr(Dispatcher, "live_peers_interval_s", 0.5)

    async def scenario():
        async with started(registry):
            await asyncio.sleep(0.2)
            assert all(not w.drain() and not w.live_peers for w in workers.values()), "not before the first wait"
            await asyncio.sleep(0.5)
            for w in workers.values():
                w.drain()
                assert w.live_peers == [LivePeers(["d0", "d1", "p0"])]
            registry.remove("d1")
            await asyncio.sleep(0.8)
            for name in ("p0", "d0"):
                workers[name].drain()
                assert workers[name].live_peers[-1] == LivePeers(["d0", "p0"])

    run(scenario())


def test_a_prefill_worker_is_introduced_once_to_each_decode_worker_it_pairs_with_as_they_appear(cluster):
    """So that it connects to them before their first request (NIXL's agent metadata and connection, a CUDA
    IPC mapping) instead of in it. Decode workers of other weights, and workers that are draining, are not
    introduced; one that leaves and comes back is introduced again."""
    import msgspec

    registry, workers, reply = cluster
    workers["d2"] = FakeWorker(zmq.Context.instance(), "d2", "decode")
    workers["d2"].info = msgspec.structs.replace(workers["d2"].info, weights="other")

    def introduced(name="p0"):
        workers[name].drain()
        return sorted((m.peer_id, m.backend, m.endpoint) for m in workers[name].introductions)

    async def scenario():
        async with started(registry):
            await asyncio.sleep(0.6)
            endpoint = b"tcp://127.0.0.1:1"
            assert introduced() == [("d0", "tcp", endpoint), ("d1", "tcp", endpoint)]
            assert not any(introduced(name) for name in ("d0", "d1")), "only prefill workers connect out"
            registry.put(workers["d2"].info)
            draining = msgspec.structs.replace(workers["d2"].info, worker_id="d3", state="draining", weights="default")
            registry.put(draining)
            await asyncio.sleep(0.6)
            assert len(workers["p0"].introductions) == 2, "d2 serves other weights, d3 is leaving: neither"
            registry.remove("d1")
            await asyncio.sleep(0.6)
            back = msgspec.structs.replace(workers["d1"].info, transfer={"tcp": b"tcp://127.0.0.1:2"})
            registry.put(back)
            await asyncio.sleep(0.6)
            assert introduced()[-1] == ("d1", "tcp", b"tcp://127.0.0.1:2")
            assert len(workers["p0"].introductions) == 3

    try:
        run(scenario())
    finally:
        workers.pop("d2").sock.close(0)


def test_a_failed_kv_transfer_places_the_request_again_and_other_prefill_errors_end_it(cluster):
    """A prefill worker whose KV transfer fails (its decode worker died a moment ago, before the registry
    knows) says so with a retryable error: the request starts over. Any other prefill error ends the request."""
    registry, workers, reply = cluster

    async def scenario():
        async with started(registry, reply) as d:
            placing = asyncio.create_task(d.submit(list(range(50)), {}))
            _, first = await allocate_reply(workers, ["d0", "d1"], reply)
            t = await placing
            assert isinstance(await workers["p0"].next(), Prefill)
            reply.send(encode(TokenBatch("p0", [TokenDelta(t.rid, [], error="KV transfer failed: nixl: "
                                                           "NIXL_ERR_REMOTE_DISCONNECT", retryable=True)])))
            second, where = await allocate_reply(workers, ["d0", "d1"], reply)
            assert second.rid == f"{t.rid}.1"
            prefill = await workers["p0"].next()
            assert isinstance(prefill, Prefill) and prefill.rid == second.rid and prefill.decode_id == where
            assert d.placed_again == {"before_first_token": 1, "mid_stream": 0}
            assert d._decode_inflight[first] == (1 if first == where else 0)
            reply.send(encode(TokenBatch(where, [TokenDelta(second.rid, [7], finish_reason="length")])))
            delta = await asyncio.wait_for(t.queue.get(), 5)
            assert delta.error is None and delta.token_ids == [7]
            d.finish(t.rid)

            placing = asyncio.create_task(d.submit(list(range(50)), {"temperature": 0.5}))
            await allocate_reply(workers, ["d0", "d1"], reply)
            u = await placing
            await workers["p0"].next()
            reply.send(encode(TokenBatch("p0", [TokenDelta(u.rid, [], error="the prompt is too long")])))
            delta = await asyncio.wait_for(u.queue.get(), 5)
            assert delta.error == "the prompt is too long" and d.placed_again["before_first_token"] == 1
            d.finish(u.rid)
            assert set(d._decode_inflight.values()) == {0} and d._prefill_inflight["p0"] == 0

    run(scenario())


def test_workers_of_another_tensor_parallel_size_are_never_paired(cluster):
    """Rank r's pages go to the peer's rank r, so a prefill worker of one rank pairs only with decode workers
    of one rank: d1 (two ranks, each with one of the two KV heads) is never asked."""
    import msgspec

    registry, workers, reply = cluster
    d1 = workers["d1"].info
    registry.put(msgspec.structs.replace(d1, layout=KVLayout(2, 16, 1, 32, "float32", tp_size=2)))

    async def scenario():
        async with started(registry, reply) as d:
            placing = [asyncio.create_task(d.submit([1, 2, 3], {})) for _ in range(3)]
            for _ in range(3):
                msg, name = await allocate_reply(workers, ["d0", "d1"], reply)
                assert name == "d0"
            placed = await asyncio.gather(*placing)
            assert [t.decode_id for t in placed] == ["d0"] * 3
            assert not [m for m in workers["d1"].drain() if isinstance(m, Allocate)]

    run(scenario())


@pytest.fixture
def two_prefills(cluster):
    """The cluster with a second prefill worker, p1."""
    registry, workers, reply = cluster
    ctx = zmq.Context()
    workers["p1"] = FakeWorker(ctx, "p1", "prefill")
    registry.put(workers["p1"].info)
    yield cluster
    workers["p1"].sock.close(0)
    ctx.term()


async def place_through(d, workers, reply, prompt, near=None):
    """Submit a request, answer its Allocate, and see its Prefill arrive; the placed request."""
    placing = asyncio.create_task(d.submit(prompt, {}, near=near))
    await allocate_reply(workers, ["d0", "d1"], reply)
    t = await placing
    assert isinstance(await workers[t.prefill_id].next(), Prefill)
    return t


def test_samples_of_one_prompt_go_to_the_workers_of_the_first(two_prefills):
    """Another sample of a prompt (near=) goes to the prefill and decode workers of the first, busy as they
    are, where the prompt's pages are cached; a request with no such tie goes to the idle ones."""
    registry, workers, reply = two_prefills
    prompt = list(range(200))

    async def scenario():
        async with started(registry, reply) as d:
            first = await place_through(d, workers, reply, prompt)
            sample = await place_through(d, workers, reply, prompt, near=first)
            other = await place_through(d, workers, reply, prompt)
            assert (sample.prefill_id, sample.decode_id) == (first.prefill_id, first.decode_id)
            assert other.prefill_id != first.prefill_id and other.decode_id != first.decode_id

    run(scenario())


def test_what_the_coordinator_knows_of_a_prefill_workers_cache_goes_with_the_worker(two_prefills):
    """Each prefill worker's index of the prompts it was sent holds up to 100,000 page hashes: a worker that
    leaves the registry takes its index along, or they would pile up as workers come and go."""
    registry, workers, reply = two_prefills

    async def scenario():
        async with started(registry, reply) as d:
            t = await place_through(d, workers, reply, list(range(200)))
            dead = t.prefill_id  # (the request moves to the other prefill worker)
            assert d._prefix[dead].seen
            registry.remove(dead)
            for _ in range(200):
                if dead not in d._prefix:
                    break
                await asyncio.sleep(0.01)
            assert dead not in d._prefix

    run(scenario())


def test_a_prompt_goes_where_its_prefix_saves_more_than_the_queue_costs(two_prefills):
    """A prefill worker with 40 tokens in flight but the first 192 of a prompt cached is done with it sooner
    than an idle one that would compute all 210."""
    registry, workers, reply = two_prefills
    shared = list(range(200))

    async def scenario():
        async with started(registry, reply) as d:
            first = await place_through(d, workers, reply, shared)
            reply.send(encode(TokenBatch(first.decode_id, [TokenDelta(first.wire, [5])])))  # its prefill is over
            for _ in range(100):
                if d._prefill_inflight[first.prefill_id] == 0:
                    break
                await asyncio.sleep(0.01)
            busy = await place_through(d, workers, reply, [7] * 40, near=first)  # 40 tokens in flight there
            assert busy.prefill_id == first.prefill_id
            extended = await place_through(d, workers, reply, shared + list(range(500, 510)))
            assert extended.prefill_id == first.prefill_id
            unrelated = await place_through(d, workers, reply, list(range(300, 510)))
            assert unrelated.prefill_id != first.prefill_id

    run(scenario())


def test_prefill_and_decode_workers_pair_only_when_their_weights_agree(cluster, caplog):
    """KV from one checkpoint is garbage to another of the same shapes (two fine-tunes of a base, an upgrade
    rolled half way): a decode worker of other weights is never asked for pages, however idle, and a prefill
    worker that no decode worker matches gets no prompts, however idle."""
    import msgspec

    from engine.protocol import WorkerLoad

    registry, workers, reply = cluster
    workers["p1"] = FakeWorker(zmq.Context.instance(), "p1", "prefill")
    for name, weights in (("p0", "v1"), ("p1", "v2"), ("d0", "v2"), ("d1", "v1")):
        busy = WorkerLoad(running=50) if name == "d1" else WorkerLoad()
        workers[name].info = msgspec.structs.replace(workers[name].info, weights=weights, load=busy)
        registry.put(workers[name].info)

    async def scenario():
        async with started(registry, reply) as d:
            d._prefill_inflight["p1"] = 10**6  # p0 does the prompts: d1, though busier, is the one to pair
            for _ in range(3):
                placing = asyncio.create_task(d.submit([1, 2, 3], {}))
                _, where = await allocate_reply(workers, ["d0", "d1"], reply)
                assert (where, (await placing).prefill_id) == ("d1", "p0")
            registry.remove("d0")  # v2 has no decode worker left
            d._prefill_inflight["p1"] = 0
            d.refresh()
            for _ in range(3):
                placing = asyncio.create_task(d.submit([1, 2, 3], {}))
                await allocate_reply(workers, ["d1"], reply)
                assert (await placing).prefill_id == "p0"
            assert not [m for m in workers["p1"].drain() if isinstance(m, Prefill)]
            assert not [m for m in workers["d0"].drain() if isinstance(m, Allocate)]

    try:
        with caplog.at_level(logging.WARNING, logger="coordinator.dispatcher"):
            run(scenario())
    finally:
        workers.pop("p1").sock.close(0)
    warned = [r.getMessage() for r in caplog.records if "pairs with no" in r.getMessage()]
    assert warned == ["prefill worker p1 pairs with no decode worker (weights v2, pages "
                      f"{workers['p0'].info.layout}): it gets no requests"], "once, when d0 left"


def test_workers_whose_token_ids_mean_something_else_get_no_requests(cluster, caplog):
    """A worker started on a model of another vocabulary than the coordinator's tokenizer is left out of
    placement (and said so once), rather than handed ids that are other words, or none, to it."""
    import msgspec

    registry, workers, reply = cluster
    workers["d0"].info = msgspec.structs.replace(workers["d0"].info, vocab="other")
    registry.put(workers["d0"].info)
    for name in ("p0", "d1"):
        workers[name].info = msgspec.structs.replace(workers[name].info, vocab="ours")
        registry.put(workers[name].info)

    async def scenario():
        async with started(registry, reply, vocab="ours") as d:
            assert sorted(d.workers) == ["d1", "p0"]
            d.refresh()
            for _ in range(3):
                placing = asyncio.create_task(d.submit([1, 2, 3], {}))
                await allocate_reply(workers, ["d0", "d1"], reply)
                assert (await placing).decode_id == "d1"
            assert not [m for m in workers["d0"].drain() if isinstance(m, Allocate)]

    run(scenario())
    warned = [r for r in caplog.records if "vocabulary is not this coordinator's" in r.getMessage()]
    assert len(warned) == 1 and "d0" in warned[0].getMessage()


def test_the_prefill_worker_is_told_what_is_left_of_the_decode_workers_wait(two_prefills):
    """The decode worker holds the pages for kv_timeout_s from its reply; the prefill worker must start sending
    within what is left of that. One that gets the prompt after another prefill worker died gets less."""
    registry, workers, reply = two_prefills

    async def scenario():
        async with started(registry, reply) as d:
            placing = asyncio.create_task(d.submit(list(range(100)), {}))
            for _ in range(500):
                asked = [(n, m) for n in ("d0", "d1") for m in workers[n].drain() if isinstance(m, Allocate)]
                if asked:
                    break
                await asyncio.sleep(0.01)
            name, alloc = asked[0]
            reply.send(encode(Allocated(alloc.rid, name, [3, 4, 5, 6, 7, 8, 9], 0, kv_timeout_s=60.0)))
            t = await placing
            first = await workers[t.prefill_id].next()
            assert 59.0 < first.kv_deadline_s <= 60.0

            await asyncio.sleep(0.5)
            dead = t.prefill_id
            other = "p1" if dead == "p0" else "p0"
            registry.remove(dead)  # it dies before the first token
            assert await workers[other].next() == PeerLeft(dead)
            again = await workers[other].next()
            assert isinstance(again, Prefill) and again.rid == t.wire and again.dst_pages == first.dst_pages
            assert again.kv_deadline_s <= first.kv_deadline_s - 0.5

    run(scenario())


def test_the_coordinators_lease_reaches_a_worker_before_its_first_request_and_every_second_after(cluster,
                                                                                                 monkeypatch):
    """Workers end the requests of a coordinator that stops renewing its lease (engine/lease.py), and watch
    only coordinators that have leased: so the lease must go first, or a coordinator that died right after
    placing its first request would leave it decoding for nobody."""
    registry, workers, reply = cluster
    monkeypatch.setattr(Dispatcher, "lease_interval_s", 0.2)

    async def scenario():
        async with started(registry, reply) as d:
            placing = asyncio.create_task(d.submit([1, 2, 3], {}))
            await allocate_reply(workers, ["d0", "d1"], reply)
            t = await placing
            first = workers[t.decode_id].log
            assert isinstance(first[0], Lease) and isinstance(first[1], Allocate), first
            for w in workers.values():
                w.drain()
                w.leases.clear()
            await asyncio.sleep(1.0)
            for w in workers.values():
                w.drain()
                assert 3 <= len(w.leases) <= 6, (w.info.worker_id, len(w.leases))
                assert all(lease == Lease(d.addr, d.lease_ttl_s) for lease in w.leases)

            registry.remove("d1")  # a departed worker is no longer leased to
            await asyncio.sleep(0.5)
            workers["d1"].drain()
            workers["d1"].leases.clear()
            await asyncio.sleep(0.5)
            assert not workers["d1"].drain() and not workers["d1"].leases

    run(scenario())


def test_tokens_of_a_request_the_coordinator_does_not_know_get_their_worker_an_abort_once(cluster):
    """A worker streaming for a request this coordinator never placed (a previous coordinator process on the
    same address placed it) is told to stop, rather than decode for nobody to its max_tokens."""
    registry, workers, reply = cluster

    async def scenario():
        async with started(registry, reply):
            for i in range(3):
                reply.send(encode(TokenBatch("d0", [TokenDelta("ghost", [i])])))
            reply.send(encode(TokenBatch("d1", [TokenDelta("gone", [1], finish_reason="length"),
                                                TokenDelta("failed", [], error="out of pages")])))
            await asyncio.sleep(0.5)
            assert workers["d0"].drain() == [Abort("ghost")]
            assert workers["d1"].drain() == [], "a request that ended there needs no Abort"

    run(scenario())


def test_a_coordinator_that_stops_ends_its_requests_refuses_new_ones_and_gives_its_leases_back(cluster):
    """Past its grace on SIGTERM (coordinator/server.py), the coordinator ends what is still running with an
    error its clients read, frees it on its workers, and tells every worker it leased to that it is gone, so
    none of them goes on with its requests until the lease runs out."""
    registry, workers, reply = cluster
    reason = "the coordinator is shutting down"

    async def scenario():
        async with started(registry, reply) as d:
            placing = asyncio.create_task(d.submit([1, 2, 3], {}))
            _, dec = await allocate_reply(workers, ["d0", "d1"], reply)
            t = await placing
            assert isinstance(await workers["p0"].next(), Prefill)
            waiting = asyncio.create_task(d.submit([4, 5, 6], {}))  # its decode worker never answers
            await asyncio.sleep(0.2)

            assert d.end_all(reason) == 2
            delta = await asyncio.wait_for(t.queue.get(), 5)
            assert delta.error == reason and delta.token_ids == []
            with pytest.raises(PlacementError) as e:
                await waiting
            assert (e.value.status, str(e.value)) == (503, reason)
            with pytest.raises(PlacementError) as e:
                await d.submit([7], {})
            assert (e.value.status, str(e.value)) == (503, reason)
            assert await workers["p0"].next() == Abort(t.rid)
            seen = []
            while Abort(t.rid) not in seen:  # (after the other request's Allocate, if it went there)
                seen.append(await workers[dec].next())
            assert not d.requests and not d.by_wire and d._decode_inflight[dec] == 0
            addr = d.addr
        for w in workers.values():
            for _ in range(100):
                w.drain()
                if w.leases and w.leases[-1].ttl_s == 0:
                    break
                await asyncio.sleep(0.01)
            assert w.leases[-1] == Lease(addr, 0.0), w.info.worker_id

    run(scenario())


def test_a_draining_worker_gets_no_new_requests_and_its_last_heartbeat_takes_it_out_at_once(cluster):
    """A worker told to stop drains (engine/worker.py): requests go to the others, and once it is gone its
    last heartbeat ("stopped") takes it out of the in-process registry without waiting for it to go stale."""
    registry, workers, reply = cluster

    async def scenario():
        async with started(registry, reply) as d:
            registry.put(msgspec.structs.replace(workers["d0"].info, state="draining"))
            d.refresh()
            placing = [asyncio.create_task(d.submit([1, 2, 3], {})) for _ in range(3)]
            for _ in range(3):
                msg = await workers["d1"].next()
                assert isinstance(msg, Allocate)
                reply.send(encode(Allocated(msg.rid, "d1", [7], 0)))
            assert [t.decode_id for t in await asyncio.gather(*placing)] == ["d1"] * 3
            assert not [m for m in workers["d0"].drain() if isinstance(m, Allocate)]
            assert d.ready()

            reply.send(encode(Heartbeat(msgspec.structs.replace(workers["d0"].info, state="stopped"))))
            for _ in range(100):
                if "d0" not in d.workers:
                    break
                await asyncio.sleep(0.01)
            assert "d0" not in d.workers and "d0" not in {w.worker_id for w in registry.alive()}
            assert PeerLeft("d0") in workers["p0"].drain()

    run(scenario())
