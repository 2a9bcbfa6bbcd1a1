"""A worker runs three short requests of its own before it announces itself (engine/warmup.py), so that the
kernels' first calls are not the first client's; nothing of them is left to see or to change a result."""

from __future__ import annotations

import logging

from engine.protocol import Generate
from played import PROMPT, assert_nothing_held, errors, finished

REQUESTS = {"greedy": {"max_tokens": 12, "temperature": 0, "ignore_eos": True},
            "sampled": {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 7, "ignore_eos": True}}


def generated(played, w) -> dict[str, list[int]]:
    for rid, params in REQUESTS.items():
        played.send(w, Generate(rid, PROMPT[:40], params, played.addr))
    got = played.pump(lambda g: all(finished(g, rid) for rid in REQUESTS), w, timeout=30)
    assert not errors(got)
    return {rid: [t for m in got for d in getattr(m, "items", []) if d.rid == rid for t in d.token_ids]
            for rid in REQUESTS}


def test_a_worker_warms_up_before_it_is_announced_and_leaves_nothing_behind(played, caplog):
    with caplog.at_level(logging.INFO, logger="engine.warmup"):
        warm = played.start("colocated")
    assert any("warmed up" in r.getMessage() for r in caplog.records)
    s = warm.engine.stats()
    assert s["cached_pages"] == 0 and s["free_pages"] == s["total_pages"], s
    assert s["prefix_query_tokens"] == 0 and s["prefix_hit_tokens"] == 0 and s["running"] == 0
    assert warm.info().load.prefix_query_tokens == 0
    assert_nothing_held(warm)

    with caplog.at_level(logging.INFO, logger="engine.warmup"):
        caplog.clear()
        cold = played.start("colocated", skip_server_warmup=True)
    assert not any("warmed up" in r.getMessage() for r in caplog.records)
    assert generated(played, warm) == generated(played, cold)


def test_a_context_shorter_than_the_warm_up_prompts_still_starts(played):
    w = played.start("colocated", engine_args={"context_length": 12})
    assert w.engine.max_model_len == 12
    assert_nothing_held(w)


def test_the_warm_up_runs_a_prompt_alone_as_well_as_a_batch(played, monkeypatch):
    """A lone prompt with nothing cached takes attention's causal path (no mask), which a batch never takes:
    a first client's request is often one such, and would otherwise make that path's first call."""
    from kernels.attention import torch_backend

    seen = []
    plan = torch_backend._TorchStep.__init__

    def recording(self, *args, **kwargs):
        plan(self, *args, **kwargs)
        seen.append((self.x.batch_size, self.causal))

    monkeypatch.setattr(torch_backend._TorchStep, "__init__", recording)
    w = played.start("colocated", engine_args={"chunked_prefill_size": 256})  # prompts whole, not in chunks
    assert (1, True) in seen and any(bsz > 1 for bsz, _ in seen), seen
    assert_nothing_held(w)
