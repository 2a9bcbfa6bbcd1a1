"""A decode worker holds pages for a prompt's KV for --transfer-timeout seconds. A prefill worker that has not
started sending by then (overloaded: the prompt still queued or half computed) must write nothing into them:
it drops the prompt and says so to the decode worker, which frees the pages at once, and to the coordinator.
A decode worker whose prefill worker vanished unseen takes its pages back after a grace period.

Real prefill and decode workers (tiny Llama, NIXL: the one-sided backend, where a late write would land in
pages another request holds); the test plays the coordinator over a real ZMQ socket."""

from __future__ import annotations

import time

import pytest

from engine.protocol import TokenBatch
from played import assert_nothing_held, errors


@pytest.mark.parametrize("when", ["already past", "while queued", "half computed"])
def test_a_prompt_past_the_decode_workers_wait_is_dropped_and_its_pages_freed_at_once(played, when):
    dec = played.start("decode", transfer_timeout_s=30.0)
    pre = played.start("prefill")
    alloc = played.allocate(dec, "r1")
    assert alloc.kv_timeout_s == 30.0, "the decode worker says how long it holds the pages"
    assert dec.engine.awaiting
    played.prefill(pre, dec, alloc, -0.1 if when == "already past" else 0.3, queue_only=when == "while queued")
    if when == "while queued":
        assert pre.engine.has_work()
        time.sleep(0.4)  # nothing of it computed yet
    elif when == "half computed":
        # Sixteen tokens a step (chunked prefill): after the first steps the prompt is part way through.
        played.pump(lambda g: pre.engine.stats()["running"] > 0, pre)
        assert pre.engine.has_work()
        time.sleep(0.4)
    t0 = time.monotonic()
    got = played.pump(lambda g: errors(g) and not dec.engine.awaiting, pre, dec)
    assert time.monotonic() - t0 < 3.0, "the decode worker frees the pages on word from the prefill worker"
    assert len(errors(got)) == 1 and "--transfer-timeout" in errors(got)[0], got
    assert pre.transfers["nixl"].stats.count == 0, "nothing was sent into the decode worker's pages"
    assert_nothing_held(pre, dec)


def test_a_prompt_computed_in_time_arrives(played):
    dec = played.start("decode", transfer_timeout_s=30.0)
    pre = played.start("prefill")
    alloc = played.allocate(dec, "r1")
    played.prefill(pre, dec, alloc, alloc.kv_timeout_s)
    got = played.pump(lambda g: any(d.finish_reason for m in g if isinstance(m, TokenBatch) for d in m.items),
                       pre, dec)
    assert not errors(got)
    assert sum(len(d.token_ids) for m in got if isinstance(m, TokenBatch) for d in m.items) == 4
    assert pre.transfers["nixl"].stats.count == 1
    assert_nothing_held(pre, dec)


def test_pages_whose_prefill_worker_vanished_are_taken_back_after_the_grace(played, monkeypatch):
    import decode.role

    monkeypatch.setattr(decode.role, "WRITE_GRACE_S", 0.5)
    dec = played.start("decode", transfer_timeout_s=0.5)
    played.allocate(dec, "r1")
    t0 = time.monotonic()
    # No prefill worker ever answers. Until the timeout and the grace have passed, the pages stay reserved: a
    # prefill worker that started sending just in time may still be writing into them.
    got = played.pump(lambda g: time.monotonic() - t0 > 0.8, dec)
    assert dec.engine.awaiting and not errors(got)
    got = played.pump(lambda g: errors(g), dec)
    assert "did not arrive within 1 s" in errors(got)[0]
    assert_nothing_held(dec)
