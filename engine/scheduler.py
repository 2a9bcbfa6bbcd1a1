"""Continuous batching with chunked prefill, prefix reuse and retraction.

There are no prefill and decode phases here: each request has tokens whose KV is computed (`kv_len`) and
tokens still to compute (`len(tokens) - kv_len`); a step gives every running request some of them. A request
in decode has exactly one (its last sampled token); one in prefill, or recomputing after a retraction, has
more and gets a chunk of at most the step's remaining token budget. A request samples when its chunk reaches
the end of its tokens.

Pages: a request's page table covers its KV. Admission matches the prompt in the radix cache and shares those
pages; new pages come from the allocator, then from evicting cached pages, and when even that fails the
newest running requests are retracted (their pages cached or freed, their tokens recomputed later). Oldest
requests are never retracted for newer ones, so every request finishes.

Overlapped steps: a request's last sampled token may still be on the device (`req.pending`) when the next
step is scheduled; it counts as a token to compute, and the runner takes its id from the device. Pages let go
while a step is in flight may still be written by it, so they are held (`limbo`) until that step completes:
only then can another process (a prefill worker pushing KV) be given them.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from engine.request import Request, Status
from kvstore.allocator import PageAllocator
from kvstore.radix import RadixCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    chunked_prefill_size: int  # token budget of one step
    max_running_requests: int


@dataclass
class Chunk:
    req: Request
    start: int  # kv_len before this step
    length: int  # tokens computed in this step

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.req.total_len


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most limit (slices compare in C: O(log n) of them)."""
    lo, hi = 0, min(limit, len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, cache: RadixCache | None):
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retracted = 0
        # Step number of the newest launched, unfinished step (0: none in flight), and pages dropped while it
        # ran, each tagged with that number.
        self.fence = 0
        self.limbo: list[tuple[int, list[int]]] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        budget = self.config.chunked_prefill_size
        chunks: list[Chunk] = []
        # Oldest first: when pages run out, the newest running requests are the ones retracted.
        self.running.sort(key=lambda r: r.arrival)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.pending and req.total_len >= req.max_len:
                i += 1  # its pending token ends it (length): nothing more to compute
                continue
            todo = req.total_len - req.kv_len
            n = todo if todo == 1 else min(todo, max(budget, 0))
            if n == 0:
                i += 1
                continue
            if not self._grow(req, req.kv_len + n):
                continue  # req itself was retracted; self.running shrank
            chunks.append(Chunk(req, req.kv_len, n))
            budget -= n
            i += 1
        later: list[Request] = []
        computing = [r for r in self.running if r.total_len - r.kv_len > 1]  # prompts (or recomputes) under way
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if len(later) < self.MAX_WAITING_ON_PREFIX and self._waits_on_prefix(req, computing):
                later.append(self.waiting.popleft())
                continue
            if not self._admit(req, budget):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            if req.total_len - req.kv_len > 1:
                computing.append(req)
            n = min(req.total_len - req.kv_len, budget)
            chunks.append(Chunk(req, req.kv_len, n))
            budget -= n
        self.waiting.extendleft(reversed(later))
        return chunks

    # A waiting request is held back while a running one computes pages of a prefix they share (n samples of
    # one prompt, a burst with one long system prompt): admitted a step or so later it takes those pages from
    # the cache instead of computing them a second time. Only shares of at least MIN_SHARED_TO_WAIT tokens are
    # worth the wait; at most MAX_WAITING_ON_PREFIX requests are passed over in one step.
    MIN_SHARED_TO_WAIT = 32
    MAX_WAITING_ON_PREFIX = 64

    def _waits_on_prefix(self, req: Request, computing: list[Request]) -> bool:
        if self.cache is None or req.kv_len or req.params.prompt_logprobs is not None:
            return False
        ps = self.config.page_size
        limit = len(req.tokens) - 1  # as _admit matches
        for other in computing:
            done = other.kv_len // ps * ps  # pages computed (or in the step in flight) are in the cache
            if min(limit, len(other.tokens)) - done < self.MIN_SHARED_TO_WAIT:
                continue
            shared = _common_prefix(req.tokens, other.tokens, limit) // ps * ps
            if shared - done >= max(self.MIN_SHARED_TO_WAIT, ps):
                return True
        return False

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size)

    def _take(self, n: int) -> list[int] | None:
        if n > self.allocator.num_free and self.cache is not None:
            self.cache.evict(n - self.allocator.num_free)
        if n > self.allocator.num_free:
            return None
        return self.allocator.alloc(n)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` pages for `num_tokens` tokens, retracting newer requests if needed; False if req itself
        had to be retracted."""
        need = self._pages_for(num_tokens) - len(req.pages)
        while need > 0:
            pages = self._take(need)
            if pages is not None:
                req.pages.extend(pages)
                return True
            victim = self.running[-1]
            self.retract(victim)
            if victim is req:
                return False
        return True

    def _admit(self, req: Request, budget: int) -> bool:
        # Leave at least one token to compute: its logits give the next token. A prompt whose logprobs are
        # asked for is computed from its first token, since cached pages come without logits.
        if req.params.prompt_logprobs is None or req.scored >= req.prompt_len - 1:
            self._match(req, len(req.tokens) - 1)
        req.cached_tokens = min(req.kv_len, req.prompt_len)
        return self._take_for(req, req.kv_len + min(req.total_len - req.kv_len, budget))

    def _match(self, req: Request, num_tokens: int) -> None:
        """Share the cached pages of the longest whole-page prefix of req.tokens[:num_tokens]."""
        if self.cache is None or req.kv_len:
            return
        matched = self.cache.match(req.tokens[:num_tokens])
        if matched:
            self.allocator.retain(matched)
            req.pages = list(matched)
            req.kv_len = len(matched) * self.config.page_size

    def _take_for(self, req: Request, num_tokens: int) -> bool:
        """Pages to cover num_tokens; False, and req holds nothing, if there is no room."""
        need = self._pages_for(num_tokens) - len(req.pages)
        # Keep a page per running request in hand, so admitting does not immediately force a retraction.
        pages = self._take(need + len(self.running))
        if pages is None:
            self.allocator.release(req.pages)
            req.pages, req.kv_len = [], 0
            return False
        self.allocator.release(pages[need:])
        req.pages.extend(pages[:need])
        return True

    # --- page ownership ---------------------------------------------------------------------------------
    def cache_pages(self, req: Request) -> None:
        """Put the request's full computed pages into the prefix cache, adopting pages it already had."""
        if self.cache is None:
            return
        ps = self.config.page_size
        n_full = min(req.kv_len, len(req.tokens)) // ps
        n_full = min(n_full, len(req.pages))
        if n_full == 0:
            return
        tree_pages = self.cache.insert(req.tokens[: n_full * ps], req.pages[:n_full])
        for i, p in enumerate(tree_pages):
            if p != req.pages[i]:
                # The tree already had this page's tokens: share its copy, drop ours.
                self.allocator.retain([p])
                self.drop([req.pages[i]])
                req.pages[i] = p

    def release(self, req: Request, cache: bool = True) -> None:
        if cache:
            self.cache_pages(req)
        self.drop(req.pages)
        req.pages = []

    def drop(self, pages: list[int]) -> None:
        """Let go of pages that a step may have written; held until the step in flight, if any, completes."""
        if self.fence and pages:
            self.limbo.append((self.fence, list(pages)))
        else:
            self.allocator.release(pages)

    def settle(self, done: int) -> None:
        """Step `done` completed: pages dropped while it (or an earlier step) ran go back to the allocator."""
        keep = []
        for tag, pages in self.limbo:
            if tag <= done:
                self.allocator.release(pages)
            else:
                keep.append((tag, pages))
        self.limbo = keep
        if self.fence <= done:
            self.fence = 0

    def reserve(self, req: Request) -> bool:
        """Pages for the whole prompt of a request whose KV arrives from elsewhere; cached prefix pages are
        shared (req.kv_len says how many tokens they cover). False, holding nothing, if there is no room."""
        self._match(req, req.prompt_len - 1)
        req.cached_tokens = req.kv_len
        return self._take_for(req, req.prompt_len)

    def retract(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.kv_len = 0
        req.status = Status.WAITING
        self.num_retracted += 1
        logger.warning("KV cache pool is full. Retract requests. #retracted=1 rid=%s", req.rid)
        # Back in arrival order, ahead of anything that came later.
        pos = 0
        while pos < len(self.waiting) and self.waiting[pos].arrival < req.arrival:
            pos += 1
        self.waiting.insert(pos, req)

    def finish(self, req: Request, release: bool = True) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if release:
            self.release(req)
        req.status = Status.FINISHED

    def check(self, extra_owners=()) -> None:
        """Self-check of page accounting: every page's count equals its owners (requests + the cache)."""
        owners: dict[int, int] = {}
        for req in list(self.running) + list(self.waiting) + list(extra_owners):
            for p in req.pages:
                owners[p] = owners.get(p, 0) + 1
        for _, pages in self.limbo:
            for p in pages:
                owners[p] = owners.get(p, 0) + 1
        cached = self.cache.page_ids() if self.cache is not None else []
        for p in cached:
            owners[p] = owners.get(p, 0) + 1
        if self.cache is not None and len(cached) != self.cache.num_pages:
            raise AssertionError(f"cache lists {len(cached)} pages but counts {self.cache.num_pages}")
        self.allocator.check(owners)
        cached_set = set(cached)
        in_use = sum(1 for p, n in owners.items() if n > (p in cached_set))
        cached_only = len(owners) - in_use
        if self.allocator.num_free + cached_only + in_use != self.allocator.total:
            raise AssertionError("free + cached + in use != total")
