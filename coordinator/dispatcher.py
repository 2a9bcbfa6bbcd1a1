"""The coordinator's side of the control plane: pick workers, place requests, route tokens back.

One asyncio loop owns everything here. A request goes through
    placement: a colocated worker (Generate), or a decode worker that reserves its pages (Allocate ->
               Allocated) and then a prefill worker (Prefill) -- never prefill work with nowhere to go;
    streaming: TokenBatch messages from the decode (or colocated) worker feed the request's queue.
A watchdog fails the requests of workers that left the registry; a request still in prefill on a dead
prefill worker is placed again. It also renews this coordinator's lease with every worker (engine/lease.py),
so that workers end the requests of a coordinator that died; tokens of a request this coordinator does not
know (one of a previous process on the same address, a copy a worker kept after it was taken for dead) get
that worker an Abort. A coordinator that stops in order ends what it still has (`end_all`) and gives its
leases back, so that no worker waits out a lease for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from coordinator.registry import MemoryRegistry, Registry
from engine.outage import OutageLog
from engine.outbox import Outbox
from engine.protocol import (Abort, Allocate, Allocated, Generate, Heartbeat, Introduce, Lease, LivePeers, PeerLeft,
                             Prefill, Rejected, TokenBatch, TokenDelta, WorkerInfo, decode)
from engine.sampling_params import SamplingParams
from transfer import agree

logger = logging.getLogger(__name__)


class PlacementError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Tracked:
    rid: str
    prompt_ids: list[int]
    params: dict
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    decode_id: str | None = None
    prefill_id: str | None = None
    counted_on: str | None = None  # the decode worker whose in-flight count includes this request
    prefill_counted: int = 0  # prompt tokens of this request in the prefill worker's in-flight count
    first_token: bool = False
    done: bool = False
    alloc: Allocated | None = None
    alloc_at: float = 0.0  # when the Allocated reply came (monotonic): its kv_timeout_s counts from then
    backend: str | None = None
    attempt: int = 0  # placements so far beyond the first (a worker died under the request)
    generated: list[int] = field(default_factory=list)  # tokens delivered by the current placement
    client_prompt_len: int = 0  # the prompt as the client sent it (prompt_ids grows when placed again)
    # The workers of another sample of this prompt, preferred while they live: there this request's prompt
    # comes from the prefix caches instead of being computed and sent again.
    near_prefill: str | None = None
    near_decode: str | None = None  # or colocated
    prompt_logprobs: list | None = None  # [(logprob, top)] for prompt tokens 1.., as the first delta brought them
    # Tokens of the prompt (whole pages) that the worker computing it was recently sent: likely cached there.
    prompt_seen: int = 0
    # Set once the first token is out (the prompt's KV is in place on the decode worker) or the request ended.
    prompt_ready: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, delta: TokenDelta) -> None:
        if self.first_token or self.done:
            self.prompt_ready.set()
        self.queue.put_nowait(delta)

    @property
    def wire(self) -> str:
        """The id the workers know this placement by: a new one per attempt, so that messages still on their
        way about an abandoned attempt cannot reach this one."""
        return self.rid if self.attempt == 0 else f"{self.rid}.{self.attempt}"


def _pairs(prefill: WorkerInfo, decode: WorkerInfo) -> bool:
    """Same layout: the pages fit; same weights: the KV in them means what the decode worker expects.
    (Dispatcher._note_unpaired compares the same two fields.)"""
    return prefill.layout == decode.layout and prefill.weights == decode.weights


def _resumable(t: Tracked) -> bool:
    """Whether a request can go on from its prompt plus its tokens so far. Frequency and presence penalties
    count the tokens generated, which a new placement would see as prompt."""
    p = t.params
    left = p.get("max_tokens", SamplingParams.max_tokens)
    return not p.get("frequency_penalty") and not p.get("presence_penalty") and (
        left is None or left > len(t.generated))


class _PrefixIndex:
    """Which page-aligned prompt prefixes were sent to a prefill worker (an LRU of chained page hashes),
    so the next request with the same prefix can go where its KV is likely cached."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self.seen: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def hashes(tokens: list[int], page: int) -> list[int]:
        out, h = [], 0
        for i in range(0, len(tokens) - page + 1, page):
            h = hash((h, tuple(tokens[i:i + page])))
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.seen:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        for h in hashes:
            self.seen[h] = None
            self.seen.move_to_end(h)
        while len(self.seen) > self.capacity:
            self.seen.popitem(last=False)


class Dispatcher:
    def __init__(self, registry: Registry, host: str = "127.0.0.1", port: int | None = None,
                 transfer_backend: str = "auto", admission_timeout_s: float = 30.0, vocab: str = "",
                 lease_ttl_s: float = 15.0):
        self.registry = registry
        self.lease_ttl_s = lease_ttl_s
        # The coordinator's tokenizer (Tokenizer.vocab_digest): workers whose token ids mean something else
        # are left out, and said so once each.
        self.vocab = vocab
        self._foreign: set[str] = set()
        self._unpaired: set[str] = set()
        self._registry_outage = OutageLog(logger, "reading the worker registry")
        self.transfer_backend = transfer_backend
        self.admission_timeout_s = admission_timeout_s
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        try:
            self.pull.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as e:  # an address not of this host, a port taken
            self.ctx.destroy(linger=0)
            raise ValueError(f"cannot listen for workers on tcp://{host}:{port or '*'}: {e.strerror}") from None
        self.addr = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        # Sends never block, so plain sockets serve the event loop; only receiving needs asyncio.
        self._sync_ctx = zmq.Context()
        self.outbox = Outbox(self._sync_ctx)
        self.requests: dict[str, Tracked] = {}  # by the client-facing rid
        self.by_wire: dict[str, Tracked] = {}  # by the id of the current placement (Tracked.wire)
        self.placed_again = {"before_first_token": 0, "mid_stream": 0}
        self._replies: dict[str, asyncio.Future] = {}
        self._prefill_inflight: dict[str, int] = {}  # worker -> prompt tokens sent, first token not back
        self._decode_inflight: dict[str, int] = {}
        self._prefix: dict[str, _PrefixIndex] = {}
        self._tasks: list[asyncio.Task] = []
        self.workers: dict[str, WorkerInfo] = {}
        # The first LivePeers waits until workers have had time to report (an in-process registry starts empty).
        self._next_live_peers = time.monotonic() + self.live_peers_first_s
        self._leased: set[str] = set()  # worker addresses this coordinator's lease has been sent to
        self._next_lease = 0.0
        self._strays: OrderedDict[str, None] = OrderedDict()  # wire ids an Abort went out for, unknown here
        self.stopping: str | None = None  # why new requests are refused (set by end_all)
        self._introduced: set[tuple[str, str]] = set()  # (prefill, decode) pairs told of each other
        self._introduced_among: set[tuple[str, str, str]] = set()  # the workers when pairs were last looked for

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if not isinstance(self.registry, MemoryRegistry):
            await asyncio.to_thread(self.refresh)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watchdog())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        # A lease of no time is this coordinator saying goodbye: each worker ends whatever it still has from
        # here at once, instead of going on with it for --lease-timeout and then warning of a lost coordinator.
        for addr in self._leased:
            self.outbox.send(addr, Lease(self.addr, 0.0))
        self.outbox.close(linger_s=1.0)
        self._sync_ctx.term()
        self.pull.close(0)
        self.ctx.term()

    def _send(self, addr: str, msg) -> None:
        if addr not in self._leased:
            # Before the first request: a worker watches a coordinator only once it has had a lease from it.
            self._leased.add(addr)
            self.outbox.send(addr, Lease(self.addr, self.lease_ttl_s))
        self.outbox.send(addr, msg)

    # --- incoming -------------------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            raw = await self.pull.recv()
            msg = decode(raw)
            if msg is None:
                continue
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop the loop
                logger.exception("handling %s", type(msg).__name__)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Heartbeat):
            if isinstance(self.registry, MemoryRegistry):
                if msg.info.state == "stopped":  # its last: the watchdog sees it gone at its next look
                    self.registry.remove(msg.info.worker_id)
                    return
                self.registry.put(msg.info)
                self.workers[msg.info.worker_id] = msg.info
        elif isinstance(msg, (Allocated, Rejected)):
            fut = self._replies.pop(msg.rid, None)  # keyed by the placement's wire id
            t = self.by_wire.get(msg.rid)
            if t is not None:
                t.alloc_at = time.monotonic()
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, TokenBatch):
            for delta in msg.items:
                self._deliver(delta, msg.worker_id)

    def _deliver(self, delta: TokenDelta, worker_id: str) -> None:
        t = self.by_wire.get(delta.rid)
        if t is None:
            self._stray(delta, worker_id)
            return
        if t.done:
            return
        if delta.retryable and not t.first_token and t.attempt < self.max_attempts - 1:
            # Its KV never reached the decode worker (which may have died, before the registry knows it): the
            # prefill worker has told the decode worker to let the pages go, so start over elsewhere.
            logger.warning("placing %s again: %s", t.rid, delta.error)
            self._settle_decode(t)
            self._settle_prefill(t)
            self.placed_again["before_first_token"] += 1
            self._new_attempt(t)
            asyncio.create_task(self._place_again(t))
            return
        t.generated.extend(delta.token_ids)
        if delta.prompt_logprobs is not None and t.prompt_logprobs is None:
            t.prompt_logprobs = delta.prompt_logprobs
        # A request placed again finds its own earlier tokens in the new worker's prefix cache: not the client's.
        delta.cached_tokens = min(delta.cached_tokens, t.client_prompt_len)
        if not t.first_token and (delta.token_ids or delta.error or delta.finish_reason):
            t.first_token = True
            self._settle_prefill(t)
        if delta.finish_reason is not None or delta.error is not None:
            t.done = True
            self._settle_decode(t)
        t.push(delta)

    def _stray(self, delta: TokenDelta, worker_id: str) -> None:
        """Tokens of a request this coordinator does not know: ended here (the client left; stale tokens come
        until the worker reads the Abort), or never placed by this process (a coordinator before it on the same
        address), or a copy on a worker taken for dead and placed again elsewhere. Abort it there, once."""
        w = self.workers.get(worker_id)
        if w is None or delta.finish_reason is not None or delta.error is not None or delta.rid in self._strays:
            return
        self._strays[delta.rid] = None
        if len(self._strays) > 10_000:
            self._strays.popitem(last=False)
        self._send(w.ctrl_addr, Abort(delta.rid))

    def _settle_prefill(self, t: Tracked) -> None:
        # Idempotent, like _settle_decode: the first token, an abort, the watchdog.
        if t.prefill_counted and t.prefill_id is not None:
            self._prefill_inflight[t.prefill_id] = self._prefill_inflight.get(t.prefill_id, 0) - t.prefill_counted
        t.prefill_counted = 0

    def _count_decode(self, t: Tracked, worker_id: str) -> None:
        t.decode_id = t.counted_on = worker_id
        self._decode_inflight[worker_id] = self._decode_inflight.get(worker_id, 0) + 1

    def _settle_decode(self, t: Tracked) -> None:
        # Idempotent: a request can be settled by its last token, the watchdog, an abort and a failed
        # placement, in any order.
        if t.counted_on is not None:
            self._decode_inflight[t.counted_on] = self._decode_inflight.get(t.counted_on, 0) - 1
            t.counted_on = None

    def _unreserve(self, t: Tracked) -> None:
        self._settle_decode(t)
        t.decode_id = None

    # --- the registry's view -------------------------------------------------------------------------------
    def refresh(self) -> dict[str, WorkerInfo]:
        self.workers = {w.worker_id: w for w in self.registry.alive() if self._ours(w)}
        self._note_unpaired()
        return self.workers

    def _note_unpaired(self) -> None:
        """Say once of each prefill or decode worker that no worker of the other role can pair with (other
        weights or page layout, as while an upgrade is rolled out): it gets no requests until one can."""
        kinds = {"prefill": set(), "decode": set()}  # what pairing compares (_pairs), by role
        for w in self.workers.values():
            if w.role in kinds:
                kinds[w.role].add((w.layout, w.weights))
        for w in self.workers.values():
            if w.role not in kinds:
                continue
            other = kinds["decode" if w.role == "prefill" else "prefill"]
            if not other or (w.layout, w.weights) in other:
                self._unpaired.discard(w.worker_id)
            elif w.worker_id not in self._unpaired:
                self._unpaired.add(w.worker_id)
                logger.warning("%s worker %s pairs with no %s worker (weights %s, pages %s): it gets no requests",
                               w.role, w.worker_id, "decode" if w.role == "prefill" else "prefill", w.weights or "?",
                               w.layout)

    def _ours(self, w: WorkerInfo) -> bool:
        if not self.vocab or not w.vocab or w.vocab == self.vocab:
            return True
        if w.worker_id not in self._foreign:
            self._foreign.add(w.worker_id)
            logger.warning("worker %s (%s at %s) serves a model whose vocabulary is not this coordinator's "
                           "(%s, not %s); it gets no requests", w.worker_id, w.role, w.host, w.vocab, self.vocab)
        return False

    def serving(self) -> list[WorkerInfo]:
        """The workers that take new requests (not those draining to stop)."""
        return [w for w in self.workers.values() if w.state == "serving"]

    def ready(self) -> bool:
        roles = {w.role for w in self.serving()}
        return "colocated" in roles or {"prefill", "decode"} <= roles

    def _introduce(self, alive: dict[str, WorkerInfo]) -> None:
        """Tell each prefill worker, once, of each decode worker it pairs with (Introduce), as soon as both are
        here: it connects to it then, and not in the first request between them (a NIXL agent's metadata took
        50-70 ms of that request's TTFT on a CPU). Looked at again only when the workers, their roles or their
        states change."""
        among = {(w.worker_id, w.role, w.state) for w in alive.values()}
        if among == self._introduced_among:
            return
        self._introduced_among = among
        serving = [w for w in alive.values() if w.state == "serving"]
        for p in (w for w in serving if w.role == "prefill"):
            for d in (w for w in serving if w.role == "decode"):
                if (p.worker_id, d.worker_id) in self._introduced or not _pairs(p, d):
                    continue
                backend = agree(p.transfer, d.transfer, self.transfer_backend)
                if backend is not None:
                    self._introduced.add((p.worker_id, d.worker_id))
                    self._send(p.ctrl_addr, Introduce(d.worker_id, backend, d.transfer[backend]))

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.outbox.flush()
            before = dict(self.workers)
            try:
                alive = await asyncio.to_thread(self.refresh) if not isinstance(self.registry, MemoryRegistry) \
                    else self.refresh()
            except Exception as e:
                self._registry_outage.failed(e)
                continue
            self._registry_outage.ok()
            for gone in set(before) - set(alive):
                logger.warning("worker %s left the registry", gone)
                self._leased.discard(before[gone].ctrl_addr)
                for w in alive.values():
                    self._send(w.ctrl_addr, PeerLeft(gone))
                # Up to 100,000 page hashes: kept for departed workers, they would pile up as workers come
                # and go (a worker that comes back under the same id starts with its cache cold anyway).
                self._prefix.pop(gone, None)
                self._unpaired.discard(gone)
                self._introduced = {pair for pair in self._introduced if gone not in pair}
            self._introduce(alive)
            if time.monotonic() >= self._next_lease:
                self._next_lease = time.monotonic() + self.lease_interval_s
                for w in alive.values():
                    self._leased.add(w.ctrl_addr)
                    self.outbox.send(w.ctrl_addr, Lease(self.addr, self.lease_ttl_s))
            if time.monotonic() >= self._next_live_peers:
                # Catches what no PeerLeft was sent for: workers that died while this coordinator was down.
                self._next_live_peers = time.monotonic() + self.live_peers_interval_s
                for w in alive.values():
                    self._send(w.ctrl_addr, LivePeers(sorted(alive)))
            for t in list(self.requests.values()):
                if t.done:
                    continue
                pending = self._replies.get(t.wire)
                if pending is not None:  # still being placed: let placement try the next decode worker
                    if t.decode_id not in alive and not pending.done():
                        pending.set_result(Rejected(t.wire, t.decode_id, "worker left", retryable=True))
                        self._replies.pop(t.wire, None)
                    continue
                if t.decode_id is not None and t.decode_id not in alive:
                    dead = t.decode_id
                    self._settle_decode(t)
                    self._settle_prefill(t)
                    if not t.first_token and t.prefill_id in alive:
                        # Its prefill is still running for a worker that is gone: stop it there.
                        self._send(alive[t.prefill_id].ctrl_addr, Abort(t.wire))
                    if t.attempt < self.max_attempts - 1 and (not t.generated or _resumable(t)):
                        # Place the request again: from its prompt if nothing reached the client yet, else
                        # from its prompt and the tokens streamed so far, for the tokens still to come.
                        logger.warning("worker %s left under %s after %d tokens; placing it again", dead, t.rid,
                                       len(t.generated))
                        self.placed_again["mid_stream" if t.generated else "before_first_token"] += 1
                        self._new_attempt(t)
                        asyncio.create_task(self._place_again(t))
                        continue
                    t.done = True
                    t.push(TokenDelta(t.wire, [], error=f"worker {dead} failed"))
                elif t.prefill_id is not None and not t.first_token and t.prefill_id not in alive:
                    asyncio.create_task(self._replace_prefill(t))

    # --- placement ------------------------------------------------------------------------------------------
    max_attempts = 3  # placements of one request, when the decode worker it is on dies
    live_peers_first_s = 5.0
    live_peers_interval_s = 30.0
    # A worker ends this coordinator's requests after lease_ttl_s (--lease-timeout) without a renewal: long
    # enough for a stalled event loop or a slow network to come back, short beside the minutes a long request
    # would decode for nobody.
    lease_interval_s = 1.0

    async def submit(self, prompt_ids: list[int], params: dict, rid: str | None = None,
                     near: Tracked | None = None) -> Tracked:
        """Place a request on workers; raises PlacementError (503 when no worker takes it in time). `near`: a
        placed request with the same prompt (another of n samples), whose workers this one prefers."""
        if self.stopping is not None:
            raise PlacementError(503, self.stopping)
        t = Tracked(rid or uuid.uuid4().hex, list(prompt_ids), dict(params), client_prompt_len=len(prompt_ids))
        if near is not None:
            t.near_prefill, t.near_decode = near.prefill_id, near.decode_id
        self.requests[t.rid] = t
        self.by_wire[t.wire] = t
        try:
            await self._place(t, time.monotonic() + self.admission_timeout_s)
        except BaseException:
            self.requests.pop(t.rid, None)
            self.by_wire.pop(t.wire, None)
            raise
        return t

    def _new_attempt(self, t: Tracked) -> None:
        """Forget the request's current placement (messages about it will no longer find the request); what it
        generated becomes part of the prompt of the next, which generates only the rest."""
        self.by_wire.pop(t.wire, None)
        t.attempt += 1
        if t.generated:
            n = len(t.generated)
            sp = SamplingParams.from_dict(t.params)
            t.prompt_ids = t.prompt_ids + t.generated
            t.params = dict(t.params, min_tokens=max(0, sp.min_tokens - n), output_offset=sp.output_offset + n,
                            max_tokens=None if sp.max_tokens is None else sp.max_tokens - n)
            t.params.pop("prompt_logprobs", None)  # the client has them, with the first token
            t.generated = []
        t.first_token = False
        t.decode_id = t.prefill_id = t.alloc = t.backend = None
        self.by_wire[t.wire] = t

    async def _place_again(self, t: Tracked) -> None:
        try:
            await self._place(t, time.monotonic() + self.admission_timeout_s)
        except Exception as e:  # PlacementError, or anything else: the request must not hang
            if not isinstance(e, PlacementError):
                logger.exception("placing %s again", t.rid)
            if not t.done:
                t.done = True
                self._settle_decode(t)
                self._settle_prefill(t)
                t.push(TokenDelta(t.wire, [], error=f"placing the request again: {e}"))

    async def _place(self, t: Tracked, deadline: float) -> None:
        rejected: set[str] = set()
        while True:
            if t.done:  # aborted while placed again (abort() let go of whatever it had reserved)
                raise PlacementError(503, self.stopping or "the request ended while it was being placed")
            workers = self.serving()
            colocated = [w for w in workers if w.role == "colocated"]
            decodes = [w for w in workers if w.role == "decode" and w.worker_id not in rejected]
            prefills = [w for w in workers if w.role == "prefill"]
            if prefills and decodes:
                if await self._place_disaggregated(t, prefills, decodes, deadline, rejected):
                    return
            elif colocated:
                w = min(colocated, key=lambda w: (w.worker_id != t.near_decode, self._decode_inflight.get(w.worker_id, 0),
                                                  -w.load.free_pages))
                self._note_prefix(t, w)
                self._count_decode(t, w.worker_id)
                self._send(w.ctrl_addr, Generate(t.wire, t.prompt_ids, t.params, self.addr))
                return
            if time.monotonic() >= deadline:
                raise PlacementError(503, "no worker could take the request in time")
            if not (prefills and decodes) and not colocated:
                rejected.clear()
            await asyncio.sleep(0.05)

    def _pick_prefill(self, t: Tracked, prefills: list[WorkerInfo]) -> WorkerInfo:
        """The worker that would be done with this prompt first: the tokens it has in flight plus those of this
        prompt that its prefix cache (as far as this coordinator sent it prompts) lacks."""
        page = prefills[0].layout.page_size
        hashes = _PrefixIndex.hashes(t.prompt_ids, page)

        def key(w: WorkerInfo):
            matched = self._prefix.setdefault(w.worker_id, _PrefixIndex()).match(hashes)
            work = self._prefill_inflight.get(w.worker_id, 0) + len(t.prompt_ids) - matched * page
            return (w.worker_id != t.near_prefill, work, -matched)

        best = min(prefills, key=key)
        self._note_prefix(t, best, hashes)
        return best

    def _note_prefix(self, t: Tracked, w: WorkerInfo, hashes: list[int] | None = None) -> None:
        """t's prompt goes to w to be computed: what w was sent of it before, and that it has it now."""
        page = w.layout.page_size
        if hashes is None:
            hashes = _PrefixIndex.hashes(t.prompt_ids, page)
        idx = self._prefix.setdefault(w.worker_id, _PrefixIndex())
        t.prompt_seen = idx.match(hashes) * page
        idx.add(hashes)

    async def _place_disaggregated(self, t, prefills, decodes, deadline, rejected) -> bool:
        # Only a prefill worker some decode worker can take pages from (while a pool changes models or
        # page layouts, each half pairs with its own).
        prefills = [p for p in prefills if any(_pairs(p, d) for d in decodes)]
        if not prefills:
            return False
        prefill = self._pick_prefill(t, prefills)
        decodes.sort(key=lambda w: (w.worker_id != t.near_decode,
                                    self._decode_inflight.get(w.worker_id, 0) + w.load.running, -w.load.free_pages))
        for dec in decodes:
            backend = agree(prefill.transfer, dec.transfer, self.transfer_backend)
            if backend is None or not _pairs(prefill, dec):
                continue
            fut = asyncio.get_running_loop().create_future()
            self._replies[t.wire] = fut
            wait = max(0.0, deadline - time.monotonic())
            # Counted from the moment the Allocate leaves: requests placed while this one waits for its
            # reply must see the worker as busier, or a burst all lands on the same decode worker.
            self._count_decode(t, dec.worker_id)
            self._send(dec.ctrl_addr, Allocate(t.wire, t.prompt_ids, t.params, self.addr, backend, wait))
            try:
                reply = await asyncio.wait_for(fut, timeout=wait + 2.0)
            except asyncio.CancelledError:  # the client left while the decode worker was reserving
                self._replies.pop(t.wire, None)
                self._send(dec.ctrl_addr, Abort(t.wire))
                self._unreserve(t)
                raise
            except asyncio.TimeoutError:
                self._replies.pop(t.wire, None)
                self._send(dec.ctrl_addr, Abort(t.wire))
                self._unreserve(t)
                if t.done:  # aborted meanwhile: place it nowhere else
                    raise PlacementError(503, self.stopping or "the request was aborted while it was being placed")
                rejected.add(dec.worker_id)
                continue
            if isinstance(reply, Rejected):
                self._unreserve(t)
                if t.done:  # abort() answered for the decode worker
                    raise PlacementError(503, self.stopping or "the request was aborted while it was being placed")
                if not reply.retryable:
                    raise PlacementError(400, reply.reason)
                rejected.add(dec.worker_id)
                continue
            self._send_prefill(t, prefill, dec, backend, reply)
            return True
        return False

    def _send_prefill(self, t: Tracked, prefill: WorkerInfo, dec: WorkerInfo, backend: str, alloc: Allocated):
        t.prefill_id = prefill.worker_id
        t.alloc = alloc
        t.backend = backend
        t.prefill_counted = len(t.prompt_ids)
        self._prefill_inflight[prefill.worker_id] = self._prefill_inflight.get(prefill.worker_id, 0) + t.prefill_counted
        # What is left of the decode worker's wait, as far as this clock tells (a prefill worker sent the prompt
        # again after another died has less of it).
        left = None if alloc.kv_timeout_s is None else alloc.kv_timeout_s - (time.monotonic() - t.alloc_at)
        self._send(prefill.ctrl_addr, Prefill(t.wire, t.prompt_ids, t.params, self.addr, dec.worker_id, dec.ctrl_addr,
                                              backend, dec.transfer[backend], alloc.pages, alloc.skip_pages, left))

    async def _replace_prefill(self, t: Tracked) -> None:
        """The prefill worker died before the first token: the decode worker still holds the pages, so
        send the prompt to another prefill worker."""
        dead = t.prefill_id
        self._settle_prefill(t)
        t.prefill_id = None
        dec = self.workers.get(t.decode_id)
        candidates = [w for w in self.serving() if w.role == "prefill" and w.worker_id != dead]
        if dec is None or not candidates or t.done:
            t.done = True
            self._settle_decode(t)
            t.push(TokenDelta(t.wire, [], error=f"prefill worker {dead} failed"))
            return
        logger.warning("prefill worker %s left; sending %s elsewhere", dead, t.rid)
        self._send_prefill(t, self._pick_prefill(t, candidates), dec, t.backend, t.alloc)

    def abort(self, rid: str) -> None:
        """The client went away (or a stop string ended it): free the request on every worker."""
        t = self.requests.pop(rid, None)
        if t is None:
            return
        self.by_wire.pop(t.wire, None)
        fut = self._replies.pop(t.wire, None)
        if fut is not None and not fut.done():  # a placement waiting for a reservation: end it now
            fut.set_result(Rejected(t.wire, "", "the request was aborted", retryable=False))
        for wid in {t.decode_id, t.prefill_id} - {None}:
            w = self.workers.get(wid)
            if w is not None:
                self._send(w.ctrl_addr, Abort(t.wire))
        t.done = True
        t.prompt_ready.set()
        self._settle_prefill(t)
        self._settle_decode(t)

    def end_all(self, reason: str) -> int:
        """The coordinator is going away: refuse new requests, and end every request still here with `reason`
        as the error its client gets, freeing it on its workers. Returns how many were ended."""
        self.stopping = reason
        ended = list(self.requests.values())
        for t in ended:
            self.abort(t.rid)
            t.push(TokenDelta(t.wire, [], error=reason))
        return len(ended)

    def finish(self, rid: str) -> None:
        t = self.requests.pop(rid, None)
        if t is not None:
            self.by_wire.pop(t.wire, None)
