"""Workers end the requests of a coordinator that stopped renewing its lease (it was killed, or cut off):
nobody would read their tokens, and they would decode to their max_tokens, holding pages and batch slots.

Real prefill and decode workers (tiny Llama, NIXL); the test plays the coordinator and says when it renews.
The coordinator's side (a lease before the first request, then every second) is in test_dispatcher.py; a
killed coordinator process in test_cluster.py."""

from __future__ import annotations

import time

from engine.protocol import Generate, Lease
from played import PROMPT, assert_nothing_held, errors, finished, tokens

# As long as the tiny model's 512 positions allow (a short prompt): about three seconds of decoding here.
LONG = {"max_tokens": 500, "temperature": 0, "ignore_eos": True}
SHORT_PROMPT = PROMPT[:8]
TTL = 0.3


def test_a_decoding_request_lives_while_its_coordinator_renews_and_ends_soon_after_it_stops(played):
    dec = played.start("decode")
    pre = played.start("prefill")
    renew = lambda: [played.send(w, Lease(played.addr, TTL)) for w in (dec, pre)]
    renew()
    alloc = played.allocate(dec, "r1", LONG, SHORT_PROMPT)
    played.prefill(pre, dec, alloc, alloc.kv_timeout_s, params=LONG, prompt=SHORT_PROMPT)
    got = played.pump(lambda g: tokens(g) > 0, pre, dec, every=renew)

    # Renewed every round for three times the lease: decoding goes on.
    t0 = time.monotonic()
    got += played.pump(lambda g: time.monotonic() - t0 > 3 * TTL, pre, dec, every=renew)
    assert not errors(got) and dec.engine.stats()["running"] == 1, (tokens(got), [d.finish_reason for m in got for d in getattr(m, "items", [])][-3:])
    before = tokens(got)

    # The coordinator falls silent: within the lease (and the worker's quarter-second check), it is over.
    t0 = time.monotonic()
    got = played.pump(lambda g: errors(g), pre, dec)
    assert time.monotonic() - t0 < TTL + 1.0
    assert f"was not heard from for {TTL:g} s" in errors(got)[0]
    assert before + tokens(got) < LONG["max_tokens"]
    assert_nothing_held(pre, dec)


def test_prompts_of_a_silent_coordinator_are_dropped_and_their_pages_freed(played):
    dec = played.start("decode")
    pre = played.start("prefill")
    for w in (dec, pre):
        played.send(w, Lease(played.addr, TTL))
    played.pump(lambda g: len(pre.leases) == 1, pre)
    alloc = played.allocate(dec, "r1", LONG)
    played.prefill(pre, dec, alloc, alloc.kv_timeout_s, queue_only=True, params=LONG)
    assert pre.engine.has_work() and dec.engine.awaiting
    time.sleep(TTL + 0.1)

    # Both hear of the lapse at once: the prefill worker drops the prompt before computing any of it, and tells
    # the decode worker, whose pages wait for that word (a one-sided write could still land in them).
    got = played.pump(lambda g: len(errors(g)) == 2 and not dec.engine.awaiting, pre, dec)
    assert pre.transfers["nixl"].stats.count == 0, "nothing was sent into the decode worker's pages"
    assert all("was not heard from" in e for e in errors(got))
    assert_nothing_held(pre, dec)


def test_requests_of_a_coordinator_that_never_leased_are_left_alone(played):
    """Only coordinators that lease are watched (a lease goes before a coordinator's first request): one that
    never sends a lease is an older coordinator, or a test playing it, not a dead one."""
    col = played.start("colocated")
    played.send(col, Generate("r1", SHORT_PROMPT, LONG, played.addr))
    got = played.pump(lambda g: finished(g), col, timeout=30)
    assert not errors(got) and tokens(got) == LONG["max_tokens"]
    assert_nothing_held(col)


def test_a_coordinator_back_on_its_address_is_watched_again(played):
    """After a lapse the address is forgotten; a coordinator that comes back there (restarted, or stalled and
    recovered) leases again, and its new requests are ended only if it falls silent again."""
    col = played.start("colocated")
    played.send(col, Lease(played.addr, TTL))
    played.send(col, Generate("r1", SHORT_PROMPT, LONG, played.addr))
    got = played.pump(lambda g: errors(g), col)
    assert len(errors(got)) == 1

    renew = lambda: played.send(col, Lease(played.addr, TTL))
    renew()
    played.send(col, Generate("r2", SHORT_PROMPT, LONG, played.addr))
    got = played.pump(finished, col, every=renew, timeout=30)
    assert not errors(got) and tokens(got) == LONG["max_tokens"]
    assert_nothing_held(col)


def test_a_coordinator_that_gives_its_lease_back_has_its_requests_ended_at_once(played):
    """A coordinator stopping in order sends a Lease of no time: a long lease is not waited out, and the
    address is no longer watched (no warning of a lost coordinator later)."""
    dec = played.start("decode")
    pre = played.start("prefill")
    for w in (dec, pre):
        played.send(w, Lease(played.addr, 60.0))
    alloc = played.allocate(dec, "r1", LONG, SHORT_PROMPT)
    played.prefill(pre, dec, alloc, alloc.kv_timeout_s, params=LONG, prompt=SHORT_PROMPT)
    played.pump(lambda g: tokens(g) > 0, pre, dec)

    t0 = time.monotonic()
    for w in (dec, pre):
        played.send(w, Lease(played.addr, 0.0))
    got = played.pump(lambda g: errors(g), pre, dec)
    assert time.monotonic() - t0 < 1.0
    assert errors(got) == [f"the coordinator at {played.addr} shut down; its requests were ended"]
    assert not len(dec.leases) and not len(pre.leases)
    assert_nothing_held(pre, dec)
