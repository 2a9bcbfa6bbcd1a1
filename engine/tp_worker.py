"""A tensor-parallel worker: rank 0 runs the worker loop, ranks 1..N-1 repeat its calls.

The worker process is rank 0, the leader. It starts the other ranks, the followers, as child processes on
its host. Each follower loads its shard of the model, makes its own KV pool (its share of the KV heads) and
its own transfer engines, and reports their endpoints. From then on, every call that the leader's role makes
on the engine or on a transfer engine goes, in order, to every follower (msgpack over one ZMQ socket each),
which makes the same call. The engines are replicas of one scheduler, so every rank batches the same tokens
into the same pages and meets the others in the same collectives. Sampling agrees without a broadcast: the
logits are all-gathered, and unseeded requests draw their seeds from one seeded generator on every rank.

KV moves rank to rank. Rank r of a prefill worker pushes its heads to rank r of the decode worker, at the
endpoint the decode worker published for that rank (transfer.rank_endpoints). Each follower reports its own
transfers to rank 0 (a page set landed, a send done), and rank 0's transfer engine reports a request as sent
or landed only once every rank's part is: so no rank decodes pages whose KV is not in place, or frees pages
still being sent, and a part that never lands fails that request alone, by the usual transfer timeout.

A follower that dies ends the worker (a group cannot compute without one of its ranks), and the coordinator
places the worker's requests again elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import msgspec
import zmq

from engine.children import die_with_parent
from engine.request import Logprob
from engine.tp_follower import Hello, Landed, Sent, reports_decoder
from transfer import rank_endpoints
from transfer.base import SendResult

logger = logging.getLogger(__name__)

_enc = msgspec.msgpack.Encoder()


def group_args(engine_args):
    """The engine arguments every rank of a new group starts with: a rendezvous address and, unless the user
    chose one, a fresh seed for unseeded requests. All ranks must draw the same seeds, and a group seeded alike
    every time (or like every other group) would draw the same samples for the same prompts."""
    changes = {}
    if engine_args.dist_init_addr is None:
        changes["dist_init_addr"] = local_dist_addr()
    if engine_args.random_seed is None:
        changes["random_seed"] = secrets.randbits(63)
    return dataclasses.replace(engine_args, **changes)


def local_dist_addr() -> str:
    """A free local address for the group's torch.distributed rendezvous (all ranks on this host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _check_shardable(engine_args) -> None:
    """Refuse a model that N ranks cannot share before starting any of them, with the model's own numbers."""
    from engine.config import ModelConfig
    from engine.loader import resolve_model_dir
    from engine.parallel import TensorParallel

    config = ModelConfig.from_dir(resolve_model_dir(engine_args.model_path))
    TensorParallel(0, engine_args.tp_size).shard_config(config)


class Followers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them the leader's calls, takes their reports,
    watches them."""

    def __init__(self, engine_args, worker_id: str, host: str = "127.0.0.1", transfer_backends: str = ""):
        """`transfer_backends`: what each follower offers, as for a worker ("" for none: an offline engine)."""
        self.size = engine_args.tp_size
        _check_shardable(engine_args)
        self.ctx = zmq.Context()
        # Unix sockets in a directory only this user can enter: a PUSH socket deals its messages out to every
        # peer that connects, so no other process may connect to one.
        self.dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        self.reports = self.ctx.socket(zmq.PULL)  # what the followers tell rank 0: up, KV landed, KV sent
        self.reports.setsockopt(zmq.LINGER, 0)
        self.reports.bind(f"ipc://{self.dir}/reports")
        self.listeners: dict[str, object] = {}  # backend -> its MirroredTransfer
        self.socks: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        engine = dataclasses.asdict(engine_args)
        for rank in range(1, self.size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block a call: the follower takes them all, in order
            sock.bind(f"ipc://{self.dir}/rank{rank}")
            self.socks.append(sock)
            spec = dict(rank=rank, ops=sock.getsockopt_string(zmq.LAST_ENDPOINT),
                        reports=self.reports.getsockopt_string(zmq.LAST_ENDPOINT), leader=os.getpid(),
                        worker_id=worker_id, host=host, transfer_backends=transfer_backends, engine=engine)
            cmd = [sys.executable, "-m", "engine.tp_follower", msgspec.json.encode(spec).decode()]
            self.procs.append(subprocess.Popen(cmd, preexec_fn=die_with_parent))

    def wait_ready(self, timeout_s: float = 900.0) -> list[dict[str, bytes]]:
        """Each follower's transfer endpoints (ranks 1..N-1), once all have loaded their shards."""
        got: dict[int, dict[str, bytes]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.size - 1:
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks not ready in {timeout_s:.0f}s")
            if self.reports.poll(200):
                hello = reports_decoder.decode(self.reports.recv())
                if not isinstance(hello, Hello):
                    continue
                if hello.error is not None:
                    raise RuntimeError(f"tensor-parallel rank {hello.rank} failed to start: {hello.error}")
                got[hello.rank] = hello.endpoints
        return [got[r] for r in range(1, self.size)]

    def call(self, op: str, *args) -> None:
        raw = _enc.encode([op, *args])
        for rank, sock in enumerate(self.socks, start=1):
            try:
                # With no limit on queued calls, a send only fails where the follower's end is gone.
                sock.send(raw, flags=zmq.NOBLOCK)
            except zmq.Again:
                raise RuntimeError(f"tensor-parallel rank {rank} no longer takes calls") from None

    def collect(self) -> None:
        """Hand the followers' transfer reports to the mirrors of their backends."""
        while True:
            try:
                raw = self.reports.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                report = reports_decoder.decode(raw)
            except msgspec.DecodeError as e:  # only our own children write here; still, never die of it
                logger.warning("dropped a malformed report from a tensor-parallel rank: %s", e)
                continue
            listener = self.listeners.get(getattr(report, "backend", None))
            if listener is not None:
                listener.on_report(report)

    def check(self) -> None:
        """Raise if a follower has exited: the group cannot go on without it."""
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {p.returncode}")

    def close(self) -> None:
        try:
            self.call("stop")
        except (RuntimeError, zmq.ZMQError):
            pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for sock in self.socks:
            sock.close(0)
        self.reports.close(0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


class MirroredEngine:
    """The leader's engine as the roles see it: each call that changes its state goes to the followers first."""

    # Every this many steps the followers compare their scheduler's state with rank 0's (Engine.state_digest):
    # ranks that drifted apart would otherwise compute garbage together, silently.
    digest_every = 64

    def __init__(self, engine, followers: Followers):
        self._engine = engine
        self._followers = followers
        self._steps = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, prompt, params=None, rid: str | None = None, detokenize: bool = True,
                    prefill_only: bool = False):
        rid = rid or uuid.uuid4().hex  # every rank must know the request by the same id
        if dataclasses.is_dataclass(params):  # a SamplingParams: its fields, as the wire carries them
            params = {k: v for k, v in dataclasses.asdict(params).items() if k != "extra"}
        self._followers.call("add_request", prompt, params, rid, detokenize, prefill_only)
        return self._engine.add_request(prompt, params, rid, detokenize, prefill_only)

    def reserve(self, rid: str, prompt_ids: list[int], params):
        self._followers.call("reserve", rid, prompt_ids, params)
        return self._engine.reserve(rid, prompt_ids, params)

    def kv_arrived(self, rid: str, first_token: int, logprob: Logprob | None = None):
        lp = None if logprob is None else [logprob.token_id, logprob.logprob, [list(t) for t in logprob.top]]
        self._followers.call("kv_arrived", rid, first_token, lp)
        return self._engine.kv_arrived(rid, first_token, logprob)

    def abort(self, rid: str) -> bool:
        self._followers.call("abort", rid)
        return self._engine.abort(rid)

    def drop_held(self, rid: str) -> None:
        self._followers.call("drop_held", rid)
        self._engine.drop_held(rid)

    def step(self):
        self._followers.check()
        self._followers.call("step")
        done = self._engine.step()
        self._steps += 1
        if self._steps % self.digest_every == 0:
            self._followers.call("digest", self._engine.state_digest())
        return done

    def check(self) -> None:
        """Page accounting on every rank (a follower that finds it off exits, and the group with it)."""
        self._followers.call("check")
        self._engine.check()

    def sync(self):
        self._followers.call("sync")
        return self._engine.sync()

    def flush_cache(self) -> bool:
        self._followers.call("flush_cache")
        return self._engine.flush_cache()


class MirroredTransfer:
    """The leader's transfer engine of one backend: rank 0's part of every call here, the followers' there.
    Its endpoint is every rank's, joined (transfer.join_rank_endpoints). A request counts as sent or landed
    once rank 0's part and every follower's report of its own are in."""

    def __init__(self, name: str, transfer, followers: Followers):
        self._t = transfer
        self._name = name
        self._followers = followers
        followers.listeners[name] = self
        self._refused: set[str] = set()  # sends refused here, which the followers never heard of
        self._sending: set[str] = set()
        self._own_sent: dict[str, SendResult] = {}
        self._rank_sent: dict[str, list[Sent]] = {}
        self._expected: set[str] = set()
        self._own_landed: dict[str, bytes] = {}  # rid -> the notification that came with rank 0's part
        self._rank_landed: dict[str, set[int]] = {}

    def __getattr__(self, name):
        return getattr(self._t, name)

    def sockets(self):
        return self._t.sockets() + [self._followers.reports]

    def on_report(self, report) -> None:
        if isinstance(report, Landed) and report.rid in self._expected:
            self._rank_landed.setdefault(report.rid, set()).add(report.rank)
        elif isinstance(report, Sent) and report.rid in self._sending:
            self._rank_sent.setdefault(report.rid, []).append(report)

    def send(self, rid, peer_id, peer_endpoint, src_pages, dst_pages, notify) -> None:
        try:
            eps = rank_endpoints(peer_endpoint)
        except ValueError as e:
            eps, why = [], str(e)
        else:
            why = f"the peer has {len(eps)} ranks, this worker {self._followers.size}"
        if len(eps) != self._followers.size:
            # The registry pairs only equal layouts, tp_size included; this is a peer that lies about its own.
            self._t.done.append(self._t._record(SendResult(rid, False, f"{self._name}: {why}")))
            self._refused.add(rid)
            return
        self._sending.add(rid)
        self._followers.call("send", self._name, rid, peer_id, eps, list(src_pages), list(dst_pages), notify)
        self._t.send(rid, peer_id, eps[0], src_pages, dst_pages, notify)

    def poll_sent(self) -> list[SendResult]:
        out = []
        for res in self._t.poll_sent():
            if res.rid in self._refused:
                self._refused.discard(res.rid)
                out.append(res)
            else:
                self._own_sent[res.rid] = res
        self._followers.collect()
        for rid in [r for r in self._own_sent if len(self._rank_sent.get(r, ())) == self._followers.size - 1]:
            res = self._own_sent.pop(rid)
            failed = [r for r in self._rank_sent.pop(rid) if not r.ok]
            self._sending.discard(rid)
            if failed and res.ok:
                res = SendResult(rid, False, f"rank {failed[0].rank}: {failed[0].error}", res.nbytes, res.seconds)
            out.append(res)
        return out

    def expect(self, rid, dst_pages) -> None:
        self._expected.add(rid)
        self._followers.call("expect", self._name, rid, list(dst_pages))
        self._t.expect(rid, dst_pages)

    def forget(self, rid) -> None:
        self._expected.discard(rid)
        self._own_landed.pop(rid, None)
        self._rank_landed.pop(rid, None)
        self._followers.call("forget", self._name, rid)
        self._t.forget(rid)

    def poll_received(self) -> list[tuple[str, bytes]]:
        for rid, note in self._t.poll_received():
            self._own_landed[rid] = note
        self._followers.collect()
        out = []
        for rid in [r for r in self._own_landed if len(self._rank_landed.get(r, ())) == self._followers.size - 1]:
            out.append((rid, self._own_landed.pop(rid)))
            self._rank_landed.pop(rid)
            self._expected.discard(rid)
        return out

    def connect(self, peer_id: str, endpoint: bytes) -> None:
        eps = rank_endpoints(endpoint)
        if len(eps) != self._followers.size:
            raise ValueError(f"the peer has {len(eps)} ranks, this worker {self._followers.size}")
        self._followers.call("connect", self._name, peer_id, eps)
        self._t.connect(peer_id, eps[0])

    def drop_peer(self, peer_id: str, departed: bool = True) -> None:
        self._followers.call("drop_peer", self._name, peer_id, departed)
        self._t.drop_peer(peer_id, departed)

    def release_stale_peers(self, live: set[str], idle_s: float | None = None) -> list[str]:
        # The leader decides which peers are stale (the followers' clocks of last use differ from its own).
        stale = self._t.release_stale_peers(live, idle_s)
        for p in stale:
            self._followers.call("drop_peer", self._name, p, False)
        return stale
