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

