"""A decode worker holds pages for a prompt's KV for --transfer-timeout seconds. A prefill worker that has not
started sending by then (overloaded: the prompt still queued or half computed) must write nothing into them:
it drops the prompt and says so to the decode worker, which frees the pages at once, and to the coordinator.
A decode worker whose prefill worker vanished unseen takes its pages back after a grace period.

Real prefill and decode workers (tiny Llama, NIXL: the one-sided backend, where a late write would land in
pages another request holds); the test plays the coordinator over a real ZMQ socket."""

from __future__ import annotations

import time

import pytest
import zmq

from engine.args import EngineArgs
from engine.protocol import Allocate, Allocated, Prefill, TokenBatch, decode, encode
from engine.worker import Worker, WorkerArgs

PROMPT = [(7 * i) % 400 + 5 for i in range(200)]
PARAMS = {"max_tokens": 4, "temperature": 0}


@pytest.fixture
def workers(tiny_llama):
    path, _ = tiny_llama

    made = []
    ctx = zmq.Context()
    coord = ctx.socket(zmq.PULL)
    coord.setsockopt(zmq.LINGER, 0)
    coord.bind("tcp://127.0.0.1:*")
    push = {}

    def worker(role, **kw):
        engine = EngineArgs(model_path=path, page_size=8, max_total_tokens=1024, attention_backend="torch",
                            chunked_prefill_size=16)
        # Their loops are run by the test (no heartbeats): the coordinator is the test's socket.
        return Worker(WorkerArgs(role=role, transfer_backends="nixl", engine=engine,
                                 coordinator_addr=coord.getsockopt_string(zmq.LAST_ENDPOINT), **kw))

    class Cluster:
        addr = coord.getsockopt_string(zmq.LAST_ENDPOINT)

        def start(self, role, **kw):
            made.append(worker(role, **kw))
            return made[-1]

        def send(self, w, msg):
            if w.ctrl_addr not in push:
                push[w.ctrl_addr] = ctx.socket(zmq.PUSH)
                push[w.ctrl_addr].setsockopt(zmq.LINGER, 0)
                push[w.ctrl_addr].connect(w.ctrl_addr)
            push[w.ctrl_addr].send(encode(msg))

        def pump(self, until, *ws, timeout=5.0):
            """Run the workers' loops, collecting what reaches the coordinator, until `until(got)` holds."""
            got = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for w in ws:
                    w.run_once()
                while True:
                    try:
                        got.append(decode(coord.recv(flags=zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                if until(got):
                    return got
                time.sleep(0.002)
            raise AssertionError(f"gave up after {timeout} s with {got}")

        def allocate(self, dec, rid):
            self.send(dec, Allocate(rid, PROMPT, PARAMS, self.addr, "nixl", 1.0))
            got = self.pump(lambda g: any(isinstance(m, Allocated) for m in g), dec)
            return next(m for m in got if isinstance(m, Allocated))

        def prefill(self, pre, dec, alloc, kv_deadline_s, queue_only=False):
            msg = Prefill(alloc.rid, PROMPT, PARAMS, self.addr, dec.worker_id, dec.ctrl_addr, "nixl",
                          dec.endpoints["nixl"], alloc.pages, alloc.skip_pages, kv_deadline_s)
            if queue_only:  # what the worker's loop does with the message, and nothing else (no step)
                pre.role.handle(msg)
            else:
                self.send(pre, msg)

    yield Cluster()
    for w in made:
        w.close()
    for s in push.values():
        s.close(0)
    coord.close(0)
    ctx.term()


def errors(got) -> list[str]:
    return [d.error for m in got if isinstance(m, TokenBatch) for d in m.items if d.error]


def assert_nothing_held(*ws):
    for w in ws:
        w.engine.check()
        assert not w.engine.has_work() and not w.engine.awaiting and not w.engine.held
        s = w.engine.stats()
        assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s


@pytest.mark.parametrize("when", ["already past", "while queued", "half computed"])
def test_a_prompt_past_the_decode_workers_wait_is_dropped_and_its_pages_freed_at_once(workers, when):
    dec = workers.start("decode", transfer_timeout_s=30.0)
    pre = workers.start("prefill")
    alloc = workers.allocate(dec, "r1")
    assert alloc.kv_timeout_s == 30.0, "the decode worker says how long it holds the pages"
    assert dec.engine.awaiting
    workers.prefill(pre, dec, alloc, -0.1 if when == "already past" else 0.3, queue_only=when == "while queued")
    if when == "while queued":
        assert pre.engine.has_work()
        time.sleep(0.4)  # nothing of it computed yet
    elif when == "half computed":
        # Sixteen tokens a step (chunked prefill): after the first steps the prompt is part way through.
        workers.pump(lambda g: pre.engine.stats()["running"] > 0, pre)
        assert pre.engine.has_work()
        time.sleep(0.4)
    t0 = time.monotonic()
    got = workers.pump(lambda g: errors(g) and not dec.engine.awaiting, pre, dec)
    assert time.monotonic() - t0 < 3.0, "the decode worker frees the pages on word from the prefill worker"
    assert len(errors(got)) == 1 and "--transfer-timeout" in errors(got)[0], got
    assert pre.transfers["nixl"].stats.count == 0, "nothing was sent into the decode worker's pages"
    assert_nothing_held(pre, dec)


def test_a_prompt_computed_in_time_arrives(workers):
    dec = workers.start("decode", transfer_timeout_s=30.0)
    pre = workers.start("prefill")
    alloc = workers.allocate(dec, "r1")
    workers.prefill(pre, dec, alloc, alloc.kv_timeout_s)
    got = workers.pump(lambda g: any(d.finish_reason for m in g if isinstance(m, TokenBatch) for d in m.items),
                       pre, dec)
    assert not errors(got)
    assert sum(len(d.token_ids) for m in got if isinstance(m, TokenBatch) for d in m.items) == 4
    assert pre.transfers["nixl"].stats.count == 1
    assert_nothing_held(pre, dec)


def test_pages_whose_prefill_worker_vanished_are_taken_back_after_the_grace(workers, monkeypatch):
    import decode.role

    monkeypatch.setattr(decode.role, "WRITE_GRACE_S", 0.5)
    dec = workers.start("decode", transfer_timeout_s=0.5)
    workers.allocate(dec, "r1")
    t0 = time.monotonic()
    # No prefill worker ever answers. Until the timeout and the grace have passed, the pages stay reserved: a
    # prefill worker that started sending just in time may still be writing into them.
    got = workers.pump(lambda g: time.monotonic() - t0 > 0.8, dec)
    assert dec.engine.awaiting and not errors(got)
    got = workers.pump(lambda g: errors(g), dec)
    assert "did not arrive within 1 s" in errors(got)[0]
    assert_nothing_held(dec)
