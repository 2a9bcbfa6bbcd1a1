"""The decode role (also the colocated one): reserve pages for requests whose prompt a prefill worker
computes, take their KV and first token, decode them in the continuous batch, and stream tokens back.
A colocated worker takes Generate messages and computes the prompts itself; the rest is the same.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.protocol import (Abort, Allocate, Allocated, Generate, KVReady, Rejected, TokenBatch, TokenDelta,
                             decode, wire_prompt_logprobs)
from engine.request import Logprob

logger = logging.getLogger(__name__)

# The prefill worker starts no transfer once the --transfer-timeout it was given has passed (it fails the request
# and says so instead). Its clock of that timeout starts later than this worker's, by the messages' way through
# the coordinator, and a write started just in time must still land: the pages are kept this much longer before
# they are taken back, so that no late write reaches pages another request holds.
WRITE_GRACE_S = 10.0


@dataclass
class _Meta:
    reply_to: str
    backend: str | None = None  # None: computed here (Generate)
    deadline: float = 0.0  # awaiting KV until then (--transfer-timeout and WRITE_GRACE_S)
    aborted: bool = False  # one-sided transfer still may land: pages quarantined until then


class DecodeRole:
    def __init__(self, worker):
        self.w = worker
        self.engine = worker.engine
        self.meta: dict[str, _Meta] = {}
        self.pending_alloc: deque[tuple[float, Allocate]] = deque()

    def pending(self) -> int:
        return len(self.pending_alloc)

    def waiting_on_transfers(self) -> bool:
        return bool(self.engine.awaiting)

    # --- control messages -------------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, (Allocate, Generate)) and self.w.draining_since is not None:
            self._turn_away(msg)
        elif isinstance(msg, Allocate):
            self.pending_alloc.append((time.monotonic() + msg.wait_s, msg))
            self._allocate_pending()
        elif isinstance(msg, Generate):
            self._generate(msg)
        elif isinstance(msg, KVReady):  # only errors come this way; KV-ready comes with the pages
            if msg.error is not None:
                self._drop(msg.rid)
        elif isinstance(msg, Abort):
            self._abort(msg.rid)
        else:
            logger.warning("decode worker ignores %s", type(msg).__name__)

    def _turn_away(self, msg: Allocate | Generate) -> None:
        """Draining (engine/worker.py): a request sent before the coordinator heard of it goes elsewhere."""
        why = f"worker {self.w.worker_id} is shutting down"
        if isinstance(msg, Allocate):
            self.w.send(msg.reply_to, Rejected(msg.rid, self.w.worker_id, why, retryable=True))
        else:
            self._send(msg.reply_to, TokenDelta(msg.rid, [], error=why, retryable=True))

    def _generate(self, msg: Generate) -> None:
        try:
            self.engine.add_request(list(msg.prompt_ids), dict(msg.params), rid=msg.rid, detokenize=False)
        except (ValueError, TypeError) as e:
            self._send(msg.reply_to, TokenDelta(msg.rid, [], error=str(e)))
            return
        self.meta[msg.rid] = _Meta(msg.reply_to)

    def _allocate_pending(self) -> None:
        """Grant waiting allocations in arrival order while the pool has room; time out the rest."""
        now = time.monotonic()
        while self.pending_alloc:
            deadline, msg = self.pending_alloc[0]
            try:
                got = self.engine.reserve(msg.rid, list(msg.prompt_ids), dict(msg.params))
            except (ValueError, TypeError) as e:
                self.pending_alloc.popleft()
                self.w.send(msg.reply_to, Rejected(msg.rid, self.w.worker_id, str(e), retryable=False))
                continue
            if got is None:
                if now < deadline:
                    return
                self.pending_alloc.popleft()
                self.w.send(msg.reply_to, Rejected(msg.rid, self.w.worker_id, "decode KV pool is full"))
                continue
            self.pending_alloc.popleft()
            req, skip = got
            transfer = self.w.transfers.get(msg.backend)
            if transfer is None:
                self.engine.abort(msg.rid)
                self.w.send(msg.reply_to, Rejected(msg.rid, self.w.worker_id,
                                                   f"transfer backend {msg.backend!r} not offered", False))
                continue
            transfer.expect(msg.rid, req.pages[skip:])
            timeout = self.w.args.transfer_timeout_s
            self.meta[msg.rid] = _Meta(msg.reply_to, msg.backend, now + timeout + WRITE_GRACE_S)
            self.w.send(msg.reply_to, Allocated(msg.rid, self.w.worker_id, list(req.pages), skip, timeout))

    def _abort(self, rid: str) -> None:
        self.pending_alloc = deque((d, m) for d, m in self.pending_alloc if m.rid != rid)
        meta = self.meta.get(rid)
        if meta is None:
            return
        if rid in self.engine.awaiting and self.w.transfers[meta.backend].one_sided:
            meta.aborted = True  # its pages may still be written; free them when the write is over
            return
        self._drop(rid)

    def end_placed_by(self, reply_to: str, reason: str) -> int:
        """End every request the coordinator at `reply_to` placed here (its lease lapsed: engine/lease.py).
        It is told why, should it be alive but cut off only."""
        waiting = len(self.pending_alloc)
        self.pending_alloc = deque((d, m) for d, m in self.pending_alloc if m.reply_to != reply_to)
        ended = waiting - len(self.pending_alloc)
        for rid, meta in list(self.meta.items()):
            if meta.reply_to == reply_to and not meta.aborted:
                self._send(reply_to, TokenDelta(rid, [], error=reason))
                self._abort(rid)
                ended += 1
        return ended

    def _drop(self, rid: str) -> None:
        meta = self.meta.pop(rid, None)
        if meta is not None and meta.backend is not None:
            self.w.transfers[meta.backend].forget(rid)
        self.engine.abort(rid)

    # --- progress -------------------------------------------------------------------------------------------
    def poll_transfers(self) -> None:
        for t in self.w.transfers.values():
            for rid, note in t.poll_received():
                ready = decode(note)
                meta = self.meta.get(rid)
                if not isinstance(ready, KVReady) or meta is None or meta.aborted or ready.error is not None:
                    self._drop(rid)
                    continue
                lp = Logprob(ready.first_token, ready.logprob, list(ready.top_logprobs or [])) \
                    if ready.logprob is not None else None
                req = self.engine.kv_arrived(rid, ready.first_token, lp)
                if req is not None:
                    req.cached_tokens = max(req.cached_tokens, ready.cached_tokens)
                    if ready.prompt_logprobs is not None:
                        req.prompt_logprobs = [Logprob(t, lp, [tuple(x) for x in top]) for t, (lp, top) in
                                               zip(req.prompt_ids[1:], ready.prompt_logprobs)]
                    self.on_step([req])

    def on_step(self, reqs) -> None:
        batches: dict[str, list[TokenDelta]] = {}
        for req in reqs:
            meta = self.meta.get(req.rid)
            if meta is None:
                continue
            new = req.output_ids[req.reported:]
            lps = req.logprobs[req.reported:] if req.params.logprobs is not None else None
            req.reported += len(new)
            delta = TokenDelta(req.rid, new, [lp.logprob for lp in lps] if lps is not None else None,
                               [list(lp.top) for lp in lps] if lps is not None else None,
                               req.finish_reason, req.stop_reason if isinstance(req.stop_reason, int) else None,
                               req.cached_tokens,
                               prompt_logprobs=wire_prompt_logprobs(req) if req.reported == len(new) else None)
            batches.setdefault(meta.reply_to, []).append(delta)
            if req.finish_reason is not None:
                self.meta.pop(req.rid, None)
        for addr, items in batches.items():
            self.w.send(addr, TokenBatch(self.w.worker_id, items))

    def _send(self, addr: str, delta: TokenDelta) -> None:
        self.w.send(addr, TokenBatch(self.w.worker_id, [delta]))

    def tick(self) -> None:
        if self.pending_alloc:
            self._allocate_pending()
        now = time.monotonic()
        for rid, meta in list(self.meta.items()):
            if meta.backend is not None and rid in self.engine.awaiting and now > meta.deadline:
                # The prefill worker neither sent the KV nor said it would not (it may have died unseen).
                waited = self.w.args.transfer_timeout_s + WRITE_GRACE_S
                logger.warning("KV of %s did not arrive within %.0f s", rid, waited)
                if not meta.aborted:
                    self._send(meta.reply_to, TokenDelta(rid, [], error=f"the prompt's KV did not arrive within "
                                                                        f"{waited:.0f} s"))
                self._drop(rid)
