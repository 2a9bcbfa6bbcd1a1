"""The suite's floor row (bench/checks.py) moves exactly one input value by exactly one ulp, and only while
its run lasts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.checks import _OneUlp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_ulp_moves_one_value_to_its_neighbour_and_puts_it_back(dtype):
    model = nn.Module()
    model.embed_tokens = nn.Embedding(16, 8).to(dtype).requires_grad_(False)
    before = model.embed_tokens.weight.clone()
    with _OneUlp(model, 5):
        now = model.embed_tokens.weight
        moved = (now != before).nonzero().tolist()
        assert moved == [[5, 0]]
        old, new = before[5, 0].float().item(), now[5, 0].float().item()
        assert abs(new) > abs(old) and new * old > 0
        # Nothing representable lies between the two values.
        ulp = torch.finfo(dtype).eps * 2.0 ** torch.frexp(before[5, 0].float()).exponent.item() / 2
        assert abs(new - old) == pytest.approx(ulp)
    assert torch.equal(model.embed_tokens.weight, before)
