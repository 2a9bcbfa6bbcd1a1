"""The fold diagnostic (bench/fold.py) times only variants that compute what torch computes."""

from __future__ import annotations

import torch

from bench.fold import gemv_variants


def test_every_gemv_variant_the_fold_diagnostic_times_matches_torch():
    rows = gemv_variants(torch.device("cpu"), smoke=True)
    # Per weight dtype: qkv and gate_up in six norm variants each, o_proj and down_proj in four residual ones.
    assert len(rows) == 2 * (2 * 6 + 2 * 4)
    assert {r[1] for r in rows} == {"bf16", "FP8"}
    for label, weights, variant, us, gbs, err in rows:
        assert us > 0 and gbs > 0, (label, weights, variant)
        assert err < 2e-2, (label, weights, variant, err)
