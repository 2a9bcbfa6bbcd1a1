"""One request's stream at the coordinator: token ids from a worker in, text pieces out.

Detokenization happens here, incrementally, so stop strings are checked here too: when one matches, the
request is aborted on its worker and the stream ends with finish_reason "stop". Text that could still turn
out to be the start of a stop string is held back until it cannot.

An HTTP request with several choices (a batch of prompts, or n samples) is one Generation per choice, each
a request of its own on the workers; `collect_all` and `interleave` read them together, and whichever way the
HTTP request ends, every one of them is freed on its workers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from coordinator.dispatcher import Dispatcher, Tracked
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams


class WorkerFailed(Exception):
    pass


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    # Per streamed token: (token id, its text, logprob, [(top id, top logprob)]).
    logprobs: list[tuple[int, str, float, list]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first: bool = False  # the generation's first piece

    def extend(self, later: "Piece") -> None:
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


class Generation:
    def __init__(self, dispatcher: Dispatcher, tokenizer, prompt_ids: list[int], params: dict, metrics=None):
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.prompt_text: str | None = None  # the client's prompt as it gave it, if text
        self.scores_from: Generation | None = None  # another sample of the prompt, which scores it for this one
        self.params = params
        sp = SamplingParams.from_dict(params)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, sp.stop, sp.include_stop_str_in_output,
                                            sp.skip_special_tokens)
        self.metrics = metrics
        self.tracked: Tracked | None = None
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.start = time.monotonic()
        self._last = None
        self._sent = 0
        self._closed = False
        self._yielded = False

    @property
    def rid(self) -> str | None:
        return self.tracked.rid if self.tracked else None

    async def start_on_workers(self, near: Tracked | None = None) -> None:
        self.tracked = await self.dispatcher.submit(self.prompt_ids, self.params, near=near)

    async def pieces(self):
        """Yield Pieces until the request finishes; always leaves the workers clean (abort if cut short)."""
        t = self.tracked
        clean = False
        try:
            while True:
                # Deltas that queued up while this stream waited (the event loop busy with others) leave as one
                # piece: one chunk and one socket write for several tokens, so that a loaded coordinator spends
                # less a token, the more it is behind.
                deltas = [await t.queue.get()]
                while not t.queue.empty():
                    deltas.append(t.queue.get_nowait())
                self._observe(sum(len(d.token_ids) for d in deltas if d.error is None))
                piece = failed = None
                for delta in deltas:
                    if delta.error is not None:
                        failed = delta
                        break
                    more = self._absorb(delta)
                    if piece is None:
                        piece = more
                    else:
                        piece.extend(more)
                    if piece.finish_reason is not None:
                        break
                if failed is not None:
                    if piece is not None and (piece.text or piece.token_ids):
                        piece.first, self._yielded = not self._yielded, True
                        yield piece
                    clean = True  # the worker already dropped it
                    self._outcome("error")
                    raise WorkerFailed(failed.error)
                if piece.finish_reason is not None or piece.text or piece.token_ids:
                    piece.first, self._yielded = not self._yielded, True
                if piece.finish_reason is not None:
                    clean = delta.finish_reason is not None
                    self._outcome(piece.finish_reason)
                    yield piece
                    return
                if piece.text or piece.token_ids:
                    yield piece
        finally:
            if not self._closed:
                self._closed = True
                if clean:
                    self.dispatcher.finish(t.rid)
                else:
                    self.dispatcher.abort(t.rid)
                    if self.finish_reason is None:
                        self._outcome("abort")

    def cancel(self) -> None:
        """Free a generation whose stream is not being read (never was, or was cut off) on its workers."""
        if self.tracked is not None and not self._closed:
            self._closed = True
            self.dispatcher.abort(self.tracked.rid)
            if self.finish_reason is None:
                self._outcome("abort")

    def _observe(self, tokens: int) -> None:
        if self.metrics is None or not tokens:
            return
        now = time.monotonic()
        if self._last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe((now - self._last) / tokens)
        self._last = now

    def _absorb(self, delta) -> Piece:
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        ids = list(delta.token_ids)
        # A worker ends with "stop" only on a stop token (EOS or stop_token_ids): count it, do not show it.
        shown = ids[:-1] if delta.finish_reason == "stop" and ids else ids
        piece = Piece("", [])
        for i, tok in enumerate(ids):
            self.output_ids.append(tok)
            piece.token_ids.append(tok)
            if i >= len(shown):
                break
            before = len(self.detok.text)
            self.detok.add(tok)
            if delta.logprobs is not None:
                top = delta.top_logprobs[i] if delta.top_logprobs else []
                piece.logprobs.append((tok, self.detok.text[before:], delta.logprobs[i], top))
            if self.detok.stopped_by is not None:
                piece.finish_reason, piece.stop_reason = "stop", self.detok.stopped_by
                break
        if piece.finish_reason is None and delta.finish_reason is not None:
            self.detok.flush()
            piece.finish_reason, piece.stop_reason = delta.finish_reason, delta.stop_reason
        end = len(self.detok.text) if piece.finish_reason else self.detok.stream_len
        piece.text = self.detok.text[self._sent:end]
        self._sent = max(self._sent, end)
        self.finish_reason = piece.finish_reason
        return piece

    def _outcome(self, outcome: str) -> None:
        if self.metrics is None:
            return
        self.metrics.requests.labels(outcome).inc()
        self.metrics.prompt_tokens.inc(len(self.prompt_ids))
        self.metrics.generation_tokens.inc(len(self.output_ids))
        self.metrics.e2e.observe(time.monotonic() - self.start)

    @property
    def prompt_logprobs(self) -> list | None:
        """[(logprob, top)] for prompt tokens 1.. (params["prompt_logprobs"]), once the first token is out."""
        src = self.scores_from or self
        return src.tracked.prompt_logprobs if src.tracked is not None else None

    @property
    def text(self) -> str:
        return self.detok.text


async def collect_all(gens: list[Generation]) -> list[list[Piece]]:
    """Every generation's pieces, read concurrently. The first failure (WorkerFailed) or a cancellation ends
    all of them."""

    async def collect(gen: Generation) -> list[Piece]:
        return [p async for p in gen.pieces()]

    tasks = [asyncio.create_task(collect(g)) for g in gens]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _end(tasks, gens)


async def interleave(gens: list[Generation]):
    """(choice index, piece) from every generation as each comes; a WorkerFailed from any ends all of them."""
    if len(gens) == 1:  # no task and queue hop per token for the common case
        stream = gens[0].pieces()
        try:
            async for piece in stream:
                yield 0, piece
        finally:
            await stream.aclose()  # now, not when the collector finds it
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for piece in gen.pieces():
                queue.put_nowait((i, piece, None))
            queue.put_nowait((i, None, None))
        except WorkerFailed as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, piece, failed = await queue.get()
            if failed is not None:
                raise failed
            if piece is None:
                left -= 1
            else:
                yield i, piece
    finally:
        await _end(tasks, gens)


async def _end(tasks: list[asyncio.Task], gens: list[Generation]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for g in gens:  # a task cancelled before it ran never opened its stream, so never freed its request
        g.cancel()
