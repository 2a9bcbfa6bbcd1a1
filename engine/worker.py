"""A worker process: one engine, one poll loop, one role (prefill, decode or colocated).

The loop: take control messages from the PULL socket, let the transfer engines progress, run one engine step
when there is work, let the role report what happened, heartbeat. The role is an object the loop calls, so a
worker can change role without reloading its model.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq

from engine.args import EngineArgs
from engine.engine import Engine
from engine.lease import Leases
from engine.outage import OutageLog
from engine.outbox import Outbox
from engine.protocol import (Heartbeat, Introduce, KVLayout, Lease, LivePeers, PeerLeft, WorkerInfo, WorkerLoad, decode,
                             encode)
from engine.warmup import warm_up
from transfer import available_backends, create_transfer

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class WorkerArgs:
    role: str = "colocated"
    # Address the control socket binds; "tcp://127.0.0.1:*" picks a free port.
    host: str = "127.0.0.1"
    port: int | None = None
    # Where heartbeats go: Redis (redis_url) or the coordinator's socket (coordinator_addr).
    redis_url: str | None = None
    coordinator_addr: str | None = None
    worker_id: str | None = None
    # Transfer backends to offer: "auto" = every one available here, or a comma-separated list.
    transfer_backends: str = "auto"
    # Seconds a decode worker holds pages for a request's KV: a prefill worker that has not started sending it
    # by then fails the request (decode/role.py, prefill/role.py).
    transfer_timeout_s: float = 60.0
    heartbeat_interval_s: float = 0.5
    # On SIGTERM the worker takes no new requests and finishes those it has for up to this long; what is still
    # running then is placed again elsewhere by the coordinator. 0: stop at once. A second SIGTERM stops it.
    graceful_shutdown_timeout_s: float = 10.0
    served_model_name: str | None = None
    # Run two short requests of its own before announcing itself (engine/warmup.py), so that the first client
    # does not wait for the kernels' first calls (compiles on a GPU).
    skip_server_warmup: bool = False
    engine: EngineArgs = field(default_factory=EngineArgs)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.redis_url and not self.coordinator_addr:
            raise ValueError("a worker needs --redis-url or --coordinator-addr to announce itself")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0: any free port), got {self.port}")
        if self.coordinator_addr is not None:
            check_tcp_addr(self.coordinator_addr, "--coordinator-addr")
        for name in ("transfer_timeout_s", "heartbeat_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.graceful_shutdown_timeout_s >= 0:
            raise ValueError(f"graceful_shutdown_timeout_s must be >= 0, got {self.graceful_shutdown_timeout_s}")


def check_tcp_addr(addr: str, what: str) -> None:
    """Refuse an address ZMQ would reject with a traceback (no tcp://), or connect to forever in silence (a port
    out of range)."""
    host, sep, port = addr.removeprefix("tcp://").rpartition(":")
    if not addr.startswith("tcp://") or not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} must be tcp://HOST:PORT with a port in [1, 65535], got {addr!r}")


class Worker:
    def __init__(self, args: WorkerArgs, engine: Engine | None = None):
        self.args = args
        self.worker_id = args.worker_id or f"{args.role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.followers = None  # engine/tp_worker.py: ranks 1..N-1 of a tensor-parallel worker
        engine_args = args.engine
        if engine is None and engine_args.tp_size > 1:
            from engine.tp_worker import Followers, group_args

            if engine_args.tp_rank != 0:
                raise ValueError("a worker is rank 0 of its tensor-parallel group and starts the other ranks itself; "
                                 "leave --tp-rank out")
            engine_args = group_args(engine_args)
            self.followers = Followers(engine_args, self.worker_id, args.host, args.transfer_backends)
        try:
            self.engine = engine or Engine(engine_args)
        except BaseException:
            if self.followers is not None:
                self.followers.close()
            raise
        self.vocab_digest = self.engine.tokenizer.vocab_digest() if self.engine.tokenizer is not None else ""
        self.ctx = zmq.Context()
        self.ctrl = self.ctx.socket(zmq.PULL)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        try:
            self.ctrl.bind(f"tcp://{args.host}:{args.port or '*'}")
        except zmq.ZMQError as e:  # an address not of this host, a port taken
            self.ctx.destroy(linger=0)
            if self.followers is not None:
                self.followers.close()
            raise ValueError(f"cannot listen on tcp://{args.host}:{args.port or '*'}: {e.strerror}") from None
        self.ctrl_addr = self.ctrl.getsockopt_string(zmq.LAST_ENDPOINT)
        names = available_backends(self.engine.pool.data.is_cuda) if args.transfer_backends == "auto" \
            else args.transfer_backends.split(",")
        self.transfers = {}
        self.endpoints: dict[str, bytes] = {}  # fixed for the worker's life; published with every heartbeat
        for n in names:
            try:
                t = create_transfer(n, self.engine.pool, self.worker_id, args.host)
                self.endpoints[n] = t.endpoint()  # a backend that cannot describe itself to peers is no use
                self.transfers[n] = t
            except Exception as e:  # e.g. NIXL without UCX, CUDA IPC in a sandbox: serve with the others
                if args.transfer_backends != "auto":
                    raise
                logger.warning("transfer backend %s unavailable here: %s", n, e)
        if self.followers is not None:
            self._join_followers()
        if not args.skip_server_warmup:
            try:
                warm_up(self.engine)
            except BaseException:
                for t in self.transfers.values():
                    t.close()
                self.ctx.destroy(linger=0)
                if self.followers is not None:
                    self.followers.close()
                raise
        self._out_ctx = zmq.Context()  # its own, so that close() can wait for what the outbox still holds
        self.outbox = Outbox(self._out_ctx)
        self.leases = Leases()
        self._next_lease_check = 0.0
        self.stopping = False
        self.draining_since: float | None = None  # (monotonic) when drain() was called
        self.started_at = time.time()
        self._next_snapshot = 0.0
        self.role = make_role(args.role, self)
        self.snapshot = self.info()
        self._heartbeat = _Heartbeat(self)
        logger.info("worker %s (%s) listening on %s, transfer: %s", self.worker_id, args.role, self.ctrl_addr,
                    ", ".join(self.transfers))

    def _join_followers(self) -> None:
        """Once every rank is up: offer the backends all ranks have, publish every rank's endpoint under
        each, and route the roles' calls through the mirrors."""
        from engine.tp_worker import MirroredEngine, MirroredTransfer
        from transfer import join_rank_endpoints

        try:
            ranks = self.followers.wait_ready()
        except BaseException:
            self.followers.close()
            raise
        for n in list(self.transfers):
            if not all(n in r for r in ranks):
                logger.warning("transfer backend %s dropped: not every tensor-parallel rank has it", n)
                self.transfers.pop(n).close()
                self.endpoints.pop(n)
        self.endpoints = {n: join_rank_endpoints([ep] + [r[n] for r in ranks]) for n, ep in self.endpoints.items()}
        self.transfers = {n: MirroredTransfer(n, t, self.followers) for n, t in self.transfers.items()}
        self.engine = MirroredEngine(self.engine, self.followers)

    # --- messaging ------------------------------------------------------------------------------------------
    def send(self, addr: str, msg) -> bool:
        return self.outbox.send(addr, msg)

    def info(self) -> WorkerInfo:
        e = self.engine
        s = e.stats()
        tstats = [t.stats for t in self.transfers.values()]
        load = WorkerLoad(
            waiting=s["waiting"], running=s["running"], queued_prefill_tokens=s["queued_prefill_tokens"],
            pending_allocations=self.role.pending(), free_pages=s["free_pages"], cached_pages=s["cached_pages"],
            total_pages=s["total_pages"], prefix_query_tokens=s["prefix_query_tokens"],
            prefix_hit_tokens=s["prefix_hit_tokens"], retracted=s["retracted"],
            # Rank 0 counts its own share; every rank moves as many bytes (equal shards of the KV heads).
            transfer_bytes=sum(t.bytes for t in tstats) * e.args.tp_size, transfer_seconds=sum(t.seconds for t in tstats),
            transfer_count=sum(t.count for t in tstats), transfer_failures=sum(t.failures for t in tstats),
            transfer_peers=sum(t.peers_held() for t in self.transfers.values()),
            outbox_backlog=self.outbox.backlog())
        p = e.pool
        return WorkerInfo(
            worker_id=self.worker_id, role=self.args.role, host=self.args.host, ctrl_addr=self.ctrl_addr,
            model=self.args.served_model_name or "default",
            layout=KVLayout.of(p),
            max_total_tokens=p.max_total_num_tokens, max_model_len=e.max_model_len,
            transfer=dict(self.endpoints), load=load, pid=os.getpid(),
            started_at=self.started_at, weights=e.weights_digest, vocab=self.vocab_digest,
            state="serving" if self.draining_since is None else "draining")

    # --- stopping in order ----------------------------------------------------------------------------------
    def drain(self) -> None:
        """Take no new requests (the coordinators learn it from the next heartbeat; what reaches the worker
        before that is turned away, to be placed elsewhere) and finish the ones here."""
        if self.draining_since is not None:
            return
        self.draining_since = time.monotonic()
        self._next_snapshot = 0.0
        logger.info("draining: finishing %d request(s) within %g s, taking no new ones", self.engine.stats()["running"],
                    self.args.graceful_shutdown_timeout_s)

    def drained(self) -> bool:
        """Draining, and nothing left to finish (or no time left to finish it)."""
        if self.draining_since is None:
            return False
        if time.monotonic() - self.draining_since >= self.args.graceful_shutdown_timeout_s:
            s = self.engine.stats()
            if s["running"] or s["waiting"]:
                logger.warning("draining: %d request(s) still here after %g s are left to the coordinator to place "
                               "again", s["running"] + s["waiting"], self.args.graceful_shutdown_timeout_s)
            return True
        return not (self.engine.has_work() or self.role.pending() or self.role.waiting_on_transfers()
                    or self.outbox.backlog())


    # --- the loop -------------------------------------------------------------------------------------------
    def run(self) -> None:
        def on_sigterm(*_):
            if self.draining_since is None and self.args.graceful_shutdown_timeout_s > 0:
                self.drain()
            else:
                self.stopping = True

        signal.signal(signal.SIGTERM, on_sigterm)
        self._heartbeat.start()
        poller = zmq.Poller()
        poller.register(self.ctrl, zmq.POLLIN)
        for t in self.transfers.values():
            for sock in t.sockets():
                poller.register(sock, zmq.POLLIN)
        try:
            while not self.stopping and not self.drained():
                busy = self.engine.has_work()
                poller.poll(0 if busy else (2 if self.role.waiting_on_transfers() else 20))
                self.run_once()
        finally:
            self.close()

    def _introduce(self, msg: Introduce) -> None:
        t = self.transfers.get(msg.backend)
        if t is None:
            return
        try:
            t.connect(msg.peer_id, msg.endpoint)
        except Exception as e:  # NIXL raises its own error types; the first send tries again and reports it
            logger.warning("could not connect to transfer peer %s (%s) ahead of its first request: %s", msg.peer_id,
                           msg.backend, e)

    def run_once(self) -> None:
        if self.followers is not None:
            self.followers.check()
        self.outbox.flush()
        while True:
            try:
                raw = self.ctrl.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = decode(raw)
            if isinstance(msg, PeerLeft):
                for t in self.transfers.values():
                    t.drop_peer(msg.worker_id)
            elif isinstance(msg, Introduce):
                self._introduce(msg)
            elif isinstance(msg, LivePeers):
                live = set(msg.worker_ids)
                for t in self.transfers.values():
                    for peer in t.release_stale_peers(live):
                        logger.info("let go of transfer peer %s (%s): not in the registry", peer, t.name)
            elif isinstance(msg, Lease) and msg.ttl_s > 0:
                self.leases.renew(msg)
            elif isinstance(msg, Lease):
                self._released(msg.reply_to)
            elif msg is not None:
                self.role.handle(msg)
        self._end_orphans()
        self.role.poll_transfers()
        if self.engine.has_work():
            self.role.on_step(self.engine.step())
        self.role.tick()
        now = time.monotonic()
        if now >= self._next_snapshot:
            self._next_snapshot = now + self.args.heartbeat_interval_s / 2
            self.snapshot = self.info()

    def _end_orphans(self) -> None:
        """End the requests of coordinators whose lease ran out (engine/lease.py)."""
        now = time.monotonic()
        if now < self._next_lease_check or not len(self.leases):
            return
        self._next_lease_check = now + 0.25
        for addr, ttl in self.leases.lapsed():
            reason = (f"the coordinator at {addr} was not heard from for {ttl:g} s (it stopped or is cut off "
                      f"from this worker); its requests were ended")
            n = self.role.end_placed_by(addr, reason)
            logger.warning("%s: %d request(s) ended", reason.split(";")[0], n)

    def _released(self, addr: str) -> None:
        """A coordinator that stops in order gives its lease back: end what it placed here now."""
        self.leases.release(addr)
        n = self.role.end_placed_by(addr, f"the coordinator at {addr} shut down; its requests were ended")
        if n:
            logger.info("the coordinator at %s shut down: %d request(s) ended", addr, n)

    def close(self) -> None:
        # A drained worker's last tokens reach their coordinators before it leaves the registry: one that saw it
        # gone first would place a request that had finished again.
        self.outbox.close(linger_s=1.0 if self.draining_since is not None else 0.0)
        self._out_ctx.term()
        self._heartbeat.stop(last=msgspec.structs.replace(self.snapshot, state="stopped"))
        if self.followers is not None:
            from engine.parallel import leave_group

            self.followers.close()
            leave_group()
        for t in self.transfers.values():
            t.close()
        self.ctrl.close(0)
        self.ctx.term()


class _Heartbeat(threading.Thread):
    """Sends the worker's latest snapshot every interval, from its own thread and socket, so that a long
    engine step (a big prefill chunk) never makes a live worker look dead."""

    def __init__(self, worker: Worker):
        super().__init__(name="heartbeat", daemon=True)
        self.w = worker
        self.done = threading.Event()
        self.registry = None
        self.sock = None
        self.outage = OutageLog(logger, "heartbeat to the registry")
        if worker.args.redis_url:
            from coordinator.registry import RedisRegistry

            self.registry = RedisRegistry(worker.args.redis_url)
        else:
            self.sock = worker.ctx.socket(zmq.PUSH)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.SNDHWM, 4)
            self.sock.connect(worker.args.coordinator_addr)

    # How long a worker whose tensor-parallel rank died may take to notice it itself. A rank lost in the middle
    # of an NCCL collective leaves the main thread blocked in it (until NCCL's own timeout, minutes); the
    # worker must neither look alive meanwhile nor hold its GPUs.
    rank_loss_grace_s = 5.0

    def run(self) -> None:
        lost_at = None
        while not self.done.is_set():
            if self.w.followers is not None and lost_at is None:
                try:
                    self.w.followers.check()
                except RuntimeError as e:
                    logger.error("%s: no more heartbeats", e)
                    lost_at = time.monotonic()
            if lost_at is not None:
                if time.monotonic() - lost_at > self.rank_loss_grace_s:
                    logger.error("the worker is still running without its rank; exiting")
                    os._exit(1)
                self.done.wait(0.2)
                continue
            try:
                if self.registry is not None:
                    self.registry.put(self.w.snapshot)
                else:
                    self.sock.send(encode(Heartbeat(self.w.snapshot)), flags=zmq.NOBLOCK)
                self.outage.ok()
            except zmq.Again:
                pass
            except Exception as e:  # Redis down: keep serving, try again next beat
                self.outage.failed(e)
            self.done.wait(self.w.args.heartbeat_interval_s)

    def stop(self, last: WorkerInfo | None = None) -> None:
        """Stop beating; `last`, sent to a coordinator's in-process registry, takes the worker out of it."""
        self.done.set()
        if self.is_alive():
            self.join(timeout=2)
        if self.registry is not None:
            try:
                self.registry.remove(self.w.worker_id)
            except Exception:
                pass
            self.registry.close()
        if self.sock is not None:
            if last is not None:  # the coordinator need not wait for the worker's entry to go stale
                try:
                    self.sock.send(encode(Heartbeat(last)), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self.sock.close(500 if last is not None else 0)


def make_role(name: str, worker: Worker):
    if name == "prefill":
        from prefill.role import PrefillRole

        return PrefillRole(worker)
    from decode.role import DecodeRole

    return DecodeRole(worker)
