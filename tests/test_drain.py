"""A worker told to stop (SIGTERM) drains: it says so in its heartbeats, turns away what reaches it before the
coordinators have heard (for them to place elsewhere), finishes what it has, and then leaves; past
--graceful-shutdown-timeout it leaves anyway, and the coordinator places what was still running again.

Real workers (tiny Llama, NIXL between prefill and decode); the test plays the coordinator. The coordinator's
side (no new requests for a draining worker) is in test_dispatcher.py."""

from __future__ import annotations

import time

from engine.protocol import Allocate, Generate, Rejected, TokenBatch
from played import PROMPT, assert_nothing_held, errors, finished, tokens

SHORT_PROMPT = PROMPT[:8]
PARAMS = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}


def test_a_draining_worker_finishes_its_requests_and_turns_new_ones_away(played):
    col = played.start("colocated")
    played.send(col, Generate("r1", SHORT_PROMPT, PARAMS, played.addr))
    got = played.pump(lambda g: tokens(g) > 0, col)
    assert col.info().state == "serving" and not col.drained()

    col.drain()
    assert col.info().state == "draining"
    played.send(col, Generate("r2", SHORT_PROMPT, PARAMS, played.addr))
    got += played.pump(lambda g: finished(g, "r1"), col, timeout=30)
    turned = [d for m in got if isinstance(m, TokenBatch) for d in m.items if d.rid == "r2"]
    assert len(turned) == 1 and turned[0].retryable and "shutting down" in turned[0].error, turned
    assert errors(got) == [turned[0].error], "the running request was not cut short"
    assert tokens(got) == PARAMS["max_tokens"]
    assert col.drained()
    assert_nothing_held(col)


def test_a_draining_decode_worker_waits_for_the_kv_it_reserved_pages_for(played):
    dec = played.start("decode")
    pre = played.start("prefill")
    alloc = played.allocate(dec, "r1", PARAMS, SHORT_PROMPT)
    dec.drain()
    played.send(dec, Allocate("r2", SHORT_PROMPT, PARAMS, played.addr, "nixl", 1.0))
    got = played.pump(lambda g: any(isinstance(m, Rejected) for m in g), dec)
    no = next(m for m in got if isinstance(m, Rejected))
    assert no.rid == "r2" and no.retryable and "shutting down" in no.reason
    assert not dec.drained(), "pages reserved for a prompt's KV: it is on its way"

    played.prefill(pre, dec, alloc, alloc.kv_timeout_s, params=PARAMS, prompt=SHORT_PROMPT)
    got = played.pump(lambda g: finished(g, "r1"), pre, dec, timeout=30)
    assert not errors(got) and tokens(got) == PARAMS["max_tokens"]
    assert dec.drained()
    assert_nothing_held(pre, dec)


def test_a_draining_prefill_worker_turns_prompts_away_and_their_decode_worker_lets_the_pages_go(played):
    dec = played.start("decode")
    pre = played.start("prefill")
    alloc = played.allocate(dec, "r1", PARAMS, SHORT_PROMPT)
    pre.drain()
    played.prefill(pre, dec, alloc, alloc.kv_timeout_s, params=PARAMS, prompt=SHORT_PROMPT)
    got = played.pump(lambda g: errors(g), pre, dec)
    turned = [d for m in got if isinstance(m, TokenBatch) for d in m.items]
    assert len(turned) == 1 and turned[0].rid == "r1" and turned[0].retryable, turned
    assert "shutting down" in turned[0].error and tokens(got) == 0
    played.pump(lambda g: not dec.engine.awaiting, pre, dec)
    assert pre.drained()
    assert_nothing_held(pre, dec)


def test_past_its_grace_a_draining_worker_leaves_with_requests_still_running(played):
    col = played.start("colocated", graceful_shutdown_timeout_s=0.3)
    long = dict(PARAMS, max_tokens=400)
    played.send(col, Generate("r1", SHORT_PROMPT, long, played.addr))
    played.pump(lambda g: tokens(g) > 0, col)
    col.drain()
    t0 = time.monotonic()
    played.pump(lambda g: col.drained(), col)
    assert 0.3 <= time.monotonic() - t0 < 1.5
    assert col.engine.stats()["running"] == 1, "left to the coordinator to place again"
