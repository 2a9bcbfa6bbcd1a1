"""A request's stream at the coordinator: tokens that queued up while the stream waited leave as one piece,
with the same text, tokens, logprobs and ending as when they come one at a time."""

from __future__ import annotations

import asyncio

import pytest

from conftest import make_tokenizer_files
from coordinator.dispatcher import Tracked
from coordinator.generation import Generation, WorkerFailed
from engine.protocol import TokenDelta
from engine.tokenizer import Tokenizer

TEXT = "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 東京は 🚀 ok, the end."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(str(path))
    return Tokenizer(str(path))


class Workers:
    """The dispatcher as a Generation sees it: placement, and how the request was let go."""

    def __init__(self):
        self.finished, self.aborted = [], []

    async def submit(self, prompt_ids, params, near=None):
        return Tracked("r1", prompt_ids, params)

    def finish(self, rid):
        self.finished.append(rid)

    def abort(self, rid):
        self.aborted.append(rid)


def deltas(ids: list[int], logprobs: bool, finish: str | None = "length") -> list[TokenDelta]:
    out = [TokenDelta("r1", [t], logprobs=[-0.5 - i] if logprobs else None,
                      top_logprobs=[[(t, -0.5 - i)]] if logprobs else None) for i, t in enumerate(ids)]
    out[-1].finish_reason = finish
    return out


def run_stream(tok, params: dict, items: list[TokenDelta], queued: int):
    """Pieces of a generation whose deltas arrive `queued` at a time, the stream reading between arrivals."""
    async def go():
        workers = Workers()
        gen = Generation(workers, tok, tok.encode("hello"), params)
        await gen.start_on_workers()
        pieces = []

        async def read():
            async for piece in gen.pieces():
                pieces.append(piece)

        reader = asyncio.create_task(read())
        for i in range(0, len(items), queued):
            for d in items[i:i + queued]:
                gen.tracked.push(d)
            while gen.tracked.queue.qsize() and not reader.done():
                await asyncio.sleep(0)
        await asyncio.wait_for(reader, 5)
        return gen, pieces, workers

    return asyncio.run(go())


@pytest.mark.parametrize("logprobs", [False, True])
def test_queued_tokens_leave_as_one_piece_with_the_same_text_tokens_and_logprobs(tok, logprobs):
    items = deltas(tok.encode(TEXT, add_special_tokens=False), logprobs)
    params = {"max_tokens": len(items), "logprobs": 1 if logprobs else None}
    one_by_one = run_stream(tok, params, deltas(tok.encode(TEXT, add_special_tokens=False), logprobs), 1)
    together = run_stream(tok, params, items, len(items))
    threes = run_stream(tok, params, deltas(tok.encode(TEXT, add_special_tokens=False), logprobs), 3)
    assert len(together[1]) == 1 and len(one_by_one[1]) > len(threes[1]) > 1
    for gen, pieces, workers in (one_by_one, together, threes):
        assert "".join(p.text for p in pieces) == TEXT
        assert [t for p in pieces for t in p.token_ids] == [d.token_ids[0] for d in items]
        assert [p.first for p in pieces] == [True] + [False] * (len(pieces) - 1)
        assert pieces[-1].finish_reason == "length" and gen.finish_reason == "length"
        assert workers.finished == ["r1"] and not workers.aborted
        lps = [x for p in pieces for x in p.logprobs]
        if logprobs:
            assert [x[2] for x in lps] == [-0.5 - i for i in range(len(items))]
            assert "".join(x[1] for x in lps) == TEXT
        else:
            assert not lps


def test_a_stop_string_inside_queued_tokens_ends_the_piece_there(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    params = {"max_tokens": len(ids), "stop": ["Sylter"]}
    gen, pieces, workers = run_stream(tok, params, deltas(ids, False, finish=None), len(ids))
    assert "".join(p.text for p in pieces) == TEXT[:TEXT.index("Sylter")]
    assert pieces[-1].finish_reason == "stop" and pieces[-1].stop_reason == "Sylter"
    assert workers.aborted == ["r1"]  # the worker still runs it: it must be told to stop


def test_a_worker_error_after_queued_tokens_sends_them_then_fails(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    items = deltas(ids, False, finish=None) + [TokenDelta("r1", [], error="the decode worker died")]

    async def go():
        workers = Workers()
        gen = Generation(workers, tok, tok.encode("hello"), {"max_tokens": 16})
        await gen.start_on_workers()
        for d in items:
            gen.tracked.push(d)
        got = []
        with pytest.raises(WorkerFailed, match="died"):
            async for piece in gen.pieces():
                got.append(piece)
        return got, workers

    got, workers = asyncio.run(go())
    assert [t for p in got for t in p.token_ids] == ids
    assert workers.finished == ["r1"] and not workers.aborted  # the worker already dropped it


@pytest.mark.parametrize("clients", [1, 2])
def test_every_token_reaches_the_client_through_a_real_coordinator_at_any_pace(clients):
    """bench/coordinator.py's smoke run: a coordinator process, a stand-in worker stepping as fast as its
    tokens are taken (so they queue up and leave together) or every 5 ms, streamed and not, from one client
    process or several; it stops with an error when a client's usage counts fewer tokens than were asked for."""
    import subprocess
    import sys

    from cluster import ROOT

    r = subprocess.run([sys.executable, "-m", "bench.coordinator", "--smoke", "--clients", str(clients)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("| yes |") == 2 and r.stdout.count("| no |") == 1
