"""The engine under random load (bench/stress.py), small enough for a CPU: every sampling mode, shared
prefixes, a pool that retracts, aborts; every finished request audited and the pages accounted for."""

from __future__ import annotations

import pytest
import torch

from bench.measure import SMOKE_CONFIG, build
from bench.stress import run


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "not-overlapped"])
def test_random_load_leaves_no_request_wrong_and_no_page_astray(overlap):
    torch.manual_seed(0)
    model = build(dict(SMOKE_CONFIG), torch.device("cpu"), torch.float32)
    res = run(model, SMOKE_CONFIG["vocab_size"], 150, seed=1, max_prompt=300, device="cpu", dtype="float32",
              attention_backend="torch", max_total_tokens=1200, chunked_prefill_size=128, max_running_requests=12,
              page_size=16, random_seed=0, disable_overlap_schedule=not overlap)
    assert res["problems"] == []
    assert res["requests"] > 40 and res["aborted"] > 0 and res["tokens"] > 1000
    assert res["retracted"] > 0 and res["prefix_hits"] > 0, "the run must reach retraction and the prefix cache"



def test_random_load_on_two_tensor_parallel_ranks_keeps_them_in_step(tiny_models):
    """The same load through an LLM of two ranks: every call reaches the second rank, which must schedule,
    retract, evict and free exactly as rank 0 does. Rank 1 compares its scheduler's state with rank 0's
    every few steps and audits its pages; a difference would end it and fail the run."""
    from engine import LLM
    from engine.tp_worker import MirroredEngine

    path, _ = tiny_models["llama"]
    with LLM(path, tp_size=2, max_total_tokens=1200, chunked_prefill_size=128, max_running_requests=12,
             page_size=16) as llm:
        engine = llm.engine
        assert isinstance(engine, MirroredEngine)
        engine.digest_every = 8
        res = run(None, engine.config.vocab_size, 150, seed=1, max_prompt=300, engine=engine)
        engine.check()
        engine.sync()
        engine.step()  # the last digest and audits reach rank 1 before it is stopped
        (rank1,) = llm.followers.procs
        assert rank1.poll() is None, "rank 1 found no difference"
    assert res["problems"] == []
    assert res["requests"] > 40 and res["aborted"] > 0
    assert res["retracted"] > 0 and res["prefix_hits"] > 0, "the run must reach retraction and the prefix cache"
    assert rank1.returncode == 0
