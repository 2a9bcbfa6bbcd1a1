"""The prefill role: compute prompts in chunked batches, sample the first token, push the KV to the decode
worker the coordinator chose, and tell it the first token once the pages have landed.

The decode worker holds the destination pages for a limited time (Prefill.kv_deadline_s). A prompt not computed
by then is dropped here, whether it still waits or is half computed, and both the decode worker and the
coordinator are told: the decode worker may then reuse the pages, because nothing will be written into them."""

from __future__ import annotations

import heapq
import logging
import time

from engine.protocol import Abort, KVReady, Prefill, TokenBatch, TokenDelta, encode, wire_prompt_logprobs

logger = logging.getLogger(__name__)


class PrefillRole:
    def __init__(self, worker):
        self.w = worker
        self.engine = worker.engine
        self.meta: dict[str, Prefill] = {}
        self.deadlines: list[tuple[float, str]] = []  # (monotonic deadline, rid), a heap
        self.deadline: dict[str, float] = {}

    def pending(self) -> int:
        return 0

    def waiting_on_transfers(self) -> bool:
        return bool(self.engine.held)

    def handle(self, msg) -> None:
        if isinstance(msg, Prefill) and self.w.draining_since is not None:
            # Draining (engine/worker.py): sent before the coordinator heard. Its decode worker lets the pages
            # go and the coordinator places it again, with another prefill worker; computing it here could
            # outlast the grace and be placed again anyway.
            self._fail(msg, f"worker {self.w.worker_id} is shutting down", retryable=True)
        elif isinstance(msg, Prefill):
            self._prefill(msg)
        elif isinstance(msg, Abort):
            self.meta.pop(msg.rid, None)
            self.deadline.pop(msg.rid, None)
            self.engine.abort(msg.rid)
        else:
            logger.warning("prefill worker ignores %s", type(msg).__name__)

    def _prefill(self, msg: Prefill) -> None:
        if msg.backend not in self.w.transfers:
            return self._fail(msg, f"transfer backend {msg.backend!r} is not offered by {self.w.worker_id}")
        try:
            req = self.engine.add_request(list(msg.prompt_ids), dict(msg.params), rid=msg.rid, detokenize=False,
                                          prefill_only=True)
        except (ValueError, TypeError) as e:
            return self._fail(msg, str(e))
        n_pages = -(-req.prompt_len // self.engine.args.page_size)
        if len(msg.dst_pages) != n_pages or not 0 <= msg.skip_pages <= n_pages:
            self.engine.abort(msg.rid)
            return self._fail(msg, f"destination has {len(msg.dst_pages)} pages, the prompt needs {n_pages}")
        self.meta[msg.rid] = msg
        if msg.kv_deadline_s is not None:
            if msg.kv_deadline_s <= 0:
                return self._late(msg.rid)
            self.deadline[msg.rid] = at = time.monotonic() + msg.kv_deadline_s
            heapq.heappush(self.deadlines, (at, msg.rid))

    def end_placed_by(self, reply_to: str, reason: str) -> int:
        """Drop the prompts the coordinator at `reply_to` sent (its lease lapsed: engine/lease.py), queued or
        half computed; the decode workers waiting for their KV are told, and free the pages. A prompt whose KV
        is on its way already is left to land: its decode worker ends it."""
        ended = [msg for rid, msg in self.meta.items() if msg.reply_to == reply_to and rid not in self.engine.held]
        for msg in ended:
            del self.meta[msg.rid]
            self.deadline.pop(msg.rid, None)
            self.engine.abort(msg.rid)
            self._fail(msg, reason, log=False)  # the worker says it once for all of them
        return len(ended)

    def _late(self, rid: str) -> None:
        """The decode worker's wait for this request's KV is over: compute and send nothing more of it."""
        msg = self.meta.pop(rid)
        self.deadline.pop(rid, None)
        self.engine.abort(rid)
        self._fail(msg, "the prompt was not computed before the decode worker stopped waiting for its KV "
                        "(--transfer-timeout); the prefill workers are overloaded")

    def _fail(self, msg: Prefill, error: str, retryable: bool = False, log: bool = True) -> None:
        if log:
            logger.warning("prefill of %s failed: %s", msg.rid, error)
        self.w.send(msg.decode_ctrl, KVReady(msg.rid, -1, error=error))
        self.w.send(msg.reply_to, TokenBatch(self.w.worker_id, [TokenDelta(msg.rid, [], error=error,
                                                                           retryable=retryable)]))

    def on_step(self, reqs) -> None:
        now = time.monotonic()
        for req in reqs:
            msg = self.meta.get(req.rid)
            if msg is None or req.rid not in self.engine.held:
                continue
            if now >= self.deadline.pop(req.rid, now + 1.0):
                self._late(req.rid)
                continue
            lp = req.logprobs[0] if req.logprobs else None
            ready = KVReady(req.rid, req.output_ids[0], lp.logprob if lp else None,
                            list(lp.top) if lp else None, req.cached_tokens,
                            prompt_logprobs=wire_prompt_logprobs(req))
            n_pages = len(msg.dst_pages)
            skip = msg.skip_pages
            self.w.transfers[msg.backend].send(
                req.rid, msg.decode_id, msg.decode_endpoint, req.pages[skip:n_pages], msg.dst_pages[skip:],
                encode(ready))

    def poll_transfers(self) -> None:
        for t in self.w.transfers.values():
            for res in t.poll_sent():
                self.engine.drop_held(res.rid)
                msg = self.meta.pop(res.rid, None)
                if not res.ok and msg is not None:
                    # Most often the decode worker died: the coordinator places the request again.
                    self._fail(msg, f"KV transfer failed: {res.error}", retryable=True)

    def tick(self) -> None:
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, rid = heapq.heappop(self.deadlines)
            # Gone: sent (on_step took its deadline), failed or aborted.
            if rid in self.deadline and rid in self.meta:
                self._late(rid)
