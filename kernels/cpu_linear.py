"""Projections on the CPU: float32 ones go through oneDNN's matmul (the op torch.compile's CPU backend emits),
not the MKL call torch's `F.linear` makes.

On one token MKL takes its matrix-vector path, which runs on one thread and reads a [N, K] weight at about
half the rate oneDNN does (the embedded model's LM head: 10.8 against 24.5 GB/s on the 2-core test machine);
on a few tokens oneDNN is faster too, and on a long prompt the same. The whole embedded model decodes a third
faster at batch 1 and 4 (docs/benchmarks.md, "CPU"). The weights stay what they are (no packed copy: the tied
embedding table is still the LM head). bf16 already reaches oneDNN through `F.linear`; other dtypes are not
offered by it."""

from __future__ import annotations

import torch
import torch.nn.functional as F



def _onednn():
    """oneDNN's linear op where this build has it and it answers a small product right (a private op: a build
    or platform without it, or one where it fails, keeps F.linear)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None:
        return None
    x, w = torch.arange(6.0).view(2, 3), torch.arange(12.0).view(4, 3)
    try:
        return op if torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w)) else None
    except RuntimeError:
        return None


_ONEDNN = _onednn()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN where that is faster (float32 on the CPU)."""
    if _ONEDNN is not None and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        return _ONEDNN(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
