"""A follower: rank r >= 1 of a tensor-parallel worker, started by rank 0 (engine/tp_worker.py).

    python -m engine.tp_follower SPEC_JSON

It loads its shard of the model, makes its KV pool and transfer engines, reports their endpoints, then repeats
every call rank 0 sends it, in order, and reports what its transfers did. The messages both ways are msgpack.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque

import msgspec
import zmq

from engine.parallel import leave_group
from engine.request import Logprob

logger = logging.getLogger(__name__)

_enc = msgspec.msgpack.Encoder()


class Hello(msgspec.Struct, tag=True):
    """A follower is up (its transfer endpoints), or could not start."""

    rank: int
    endpoints: dict[str, bytes] = {}
    error: str | None = None


class Landed(msgspec.Struct, tag=True):
    """A follower's part of a request's KV is in its pool."""

    rank: int
    backend: str
    rid: str


class Sent(msgspec.Struct, tag=True):
    """A follower's part of a request's KV has left (or failed to)."""

    rank: int
    backend: str
    rid: str
    ok: bool
    error: str = ""


reports_decoder = msgspec.msgpack.Decoder(Hello | Landed | Sent)


class Follower:
    """Rank r >= 1: repeats the leader's calls on its own engine and transfer engines, and reports its
    transfers back."""

    def __init__(self, spec: dict, engine, transfers: dict, ops: zmq.Socket, reports: zmq.Socket):
        self.rank = spec["rank"]
        self.leader = spec["leader"]
        self.engine = engine
        self.transfers = transfers
        self.ops = ops
        self.reports = reports
        self.queue: deque = deque()
        self.poller = zmq.Poller()
        self.poller.register(ops, zmq.POLLIN)
        for t in transfers.values():
            for sock in t.sockets():
                self.poller.register(sock, zmq.POLLIN)

    def run(self) -> None:
        while True:
            self._pump(20 if self.transfers else 1000)
            while self.queue:
                if not self._apply(self.queue.popleft()):
                    return
                self._pump(0)  # between steps too: a report held back holds back the request

    def _pump(self, wait_ms: int) -> None:
        """Report what this rank's transfers did, and take the leader's calls. An `expect` is applied as soon
        as it is read, ahead of the calls before it: this rank's pages may arrive while it still works through
        those, and a two-sided backend drops pages it does not expect. Early is safe: the leader reserved those
        pages only once no step of any rank could still use them (the collectives keep the ranks within a
        step)."""
        self.poller.poll(wait_ms)
        for name, t in self.transfers.items():
            for rid, _ in t.poll_received():
                self.reports.send(_enc.encode(Landed(self.rank, name, rid)))
            for res in t.poll_sent():
                self.reports.send(_enc.encode(Sent(self.rank, name, res.rid, res.ok, res.error)))
        while True:
            try:
                raw = self.ops.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            op = msgspec.msgpack.decode(raw)
            if op[0] == "expect":
                self.transfers[op[1]].expect(op[2], op[3])
            else:
                self.queue.append(op)
        if os.getppid() != self.leader:
            raise SystemExit(f"rank {self.rank}: the leader (pid {self.leader}) is gone")

    def _apply(self, op: list) -> bool:
        name, args = op[0], op[1:]
        e = self.engine
        if name == "step":
            e.step()
        elif name in ("add_request", "reserve"):
            try:
                getattr(e, name)(*args)
            except (ValueError, TypeError):
                pass  # the leader met the same error and told the client
        elif name == "kv_arrived":  # (the leader saw this rank's part land first)
            rid, token, lp = args
            e.kv_arrived(rid, token, None if lp is None else Logprob(lp[0], lp[1], [tuple(t) for t in lp[2]]))
        elif name in ("abort", "drop_held"):
            getattr(e, name)(args[0])
        elif name in ("sync", "flush_cache", "check"):
            getattr(e, name)()
        elif name == "digest":
            if e.state_digest() != args[0]:
                raise SystemExit(f"rank {self.rank}: the scheduler's state differs from rank 0's; the group stops")
        elif name == "send":
            backend, rid, peer_id, eps, src, dst, notify = args
            self.transfers[backend].send(rid, peer_id, eps[self.rank], src, dst, notify)
        elif name == "forget":
            self.transfers[args[0]].forget(args[1])
        elif name == "drop_peer":
            self.transfers[args[0]].drop_peer(args[1], args[2])
        elif name == "connect":
            backend, peer_id, eps = args
            try:
                self.transfers[backend].connect(peer_id, eps[self.rank])
            except Exception as e:  # as on the leader: the first send tries again and reports it
                logger.warning("rank %d: could not connect to transfer peer %s (%s): %s", self.rank, peer_id,
                               backend, e)
        elif name == "stop":
            return False
        else:
            raise SystemExit(f"rank {self.rank}: unknown call {name!r} from the leader")
        return True


def follower_main(spec: dict) -> None:
    from engine.args import EngineArgs
    from engine.engine import Engine
    from transfer import available_backends, create_transfer

    rank = spec["rank"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.setsockopt(zmq.LINGER, 2000)
    reports.setsockopt(zmq.SNDHWM, 0)
    reports.connect(spec["reports"])
    ops = ctx.socket(zmq.PULL)
    ops.setsockopt(zmq.LINGER, 0)
    ops.connect(spec["ops"])
    transfers = {}
    try:
        engine = Engine(EngineArgs(**{**spec["engine"], "tp_rank": rank}))
        wanted = spec["transfer_backends"]
        names = available_backends(engine.pool.data.is_cuda) if wanted == "auto" else [n for n in wanted.split(",") if n]
        for n in names:
            try:
                transfers[n] = create_transfer(n, engine.pool, spec["worker_id"], spec["host"])
            except Exception as e:
                if wanted != "auto":
                    raise
                logger.warning("transfer backend %s unavailable on rank %d: %s", n, rank, e)
    except BaseException as e:
        reports.send(_enc.encode(Hello(rank, error=f"{type(e).__name__}: {e}")))
        raise
    reports.send(_enc.encode(Hello(rank, {n: t.endpoint() for n, t in transfers.items()})))
    try:
        Follower(spec, engine, transfers, ops, reports).run()
    finally:
        leave_group()
        for t in transfers.values():
            t.close()
        reports.close(0)
        ops.close(0)
        ctx.term()


if __name__ == "__main__":
    follower_main(msgspec.json.decode(sys.argv[1]))
