"""Real workers, in this process, whose coordinator the test plays over a real ZMQ socket: the test sends
the control messages, runs the workers' loops itself (no heartbeats), and sees everything sent back."""

from __future__ import annotations

import time

import zmq

from engine.args import EngineArgs
from engine.protocol import Allocate, Allocated, Prefill, TokenBatch, decode, encode
from engine.worker import Worker, WorkerArgs

PROMPT = [(7 * i) % 400 + 5 for i in range(200)]
PARAMS = {"max_tokens": 4, "temperature": 0}


class PlayedCluster:
    def __init__(self, model_path: str, backend: str = "nixl"):
        self.model_path = model_path
        self.backend = backend
        self.made: list[Worker] = []
        self.ctx = zmq.Context()
        self.coord = self.ctx.socket(zmq.PULL)
        self.coord.setsockopt(zmq.LINGER, 0)
        self.coord.bind("tcp://127.0.0.1:*")
        self.addr = self.coord.getsockopt_string(zmq.LAST_ENDPOINT)
        self.push: dict[str, zmq.Socket] = {}

    def start(self, role: str, engine_args: dict | None = None, **kw) -> Worker:
        engine = EngineArgs(**{"model_path": self.model_path, "page_size": 8, "max_total_tokens": 1024,
                               "attention_backend": "torch", "chunked_prefill_size": 16, **(engine_args or {})})
        self.made.append(Worker(WorkerArgs(role=role, transfer_backends=self.backend, engine=engine,
                                           coordinator_addr=self.addr, **kw)))
        return self.made[-1]

    def send(self, w: Worker, msg) -> None:
        if w.ctrl_addr not in self.push:
            self.push[w.ctrl_addr] = self.ctx.socket(zmq.PUSH)
            self.push[w.ctrl_addr].setsockopt(zmq.LINGER, 0)
            self.push[w.ctrl_addr].connect(w.ctrl_addr)
        self.push[w.ctrl_addr].send(encode(msg))

    def pump(self, until, *ws, timeout=5.0, every=None):
        """Run the workers' loops, collecting what reaches the coordinator, until `until(got)` holds;
        `every()` is called on each round (e.g. to renew a lease)."""
        got = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if every is not None:
                every()
            for w in ws:
                w.run_once()
            while True:
                try:
                    got.append(decode(self.coord.recv(flags=zmq.NOBLOCK)))
                except zmq.Again:
                    break
            if until(got):
                return got
            time.sleep(0.002)
        raise AssertionError(f"gave up after {timeout} s with {got}")

    def allocate(self, dec: Worker, rid: str, params: dict = PARAMS, prompt: list[int] = PROMPT) -> Allocated:
        self.send(dec, Allocate(rid, prompt, params, self.addr, self.backend, 1.0))
        got = self.pump(lambda g: any(isinstance(m, Allocated) for m in g), dec)
        return next(m for m in got if isinstance(m, Allocated))

    def prefill(self, pre: Worker, dec: Worker, alloc: Allocated, kv_deadline_s, queue_only=False,
                params: dict = PARAMS, prompt: list[int] = PROMPT) -> None:
        msg = Prefill(alloc.rid, prompt, params, self.addr, dec.worker_id, dec.ctrl_addr, self.backend,
                      dec.endpoints[self.backend], alloc.pages, alloc.skip_pages, kv_deadline_s)
        if queue_only:  # what the worker's loop does with the message, and nothing else (no step)
            pre.role.handle(msg)
        else:
            self.send(pre, msg)

    def close(self) -> None:
        for w in self.made:
            w.close()
        for s in self.push.values():
            s.close(0)
        self.coord.close(0)
        self.ctx.term()


def errors(got) -> list[str]:
    return [d.error for m in got if isinstance(m, TokenBatch) for d in m.items if d.error]


def finished(got, rid: str | None = None) -> bool:
    """A request (`rid`, or any) has had its last token."""
    return any(d.finish_reason and rid in (None, d.rid) for m in got if isinstance(m, TokenBatch) for d in m.items)


def tokens(got) -> int:
    return sum(len(d.token_ids) for m in got if isinstance(m, TokenBatch) for d in m.items)


def assert_nothing_held(*ws) -> None:
    for w in ws:
        w.engine.check()
        assert not w.engine.has_work() and not w.engine.awaiting and not w.engine.held
        s = w.engine.stats()
        assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s
