"""Float32 projections on the CPU go through oneDNN (kernels/cpu_linear.py): the same products as F.linear, to
float32 rounding, for every shape the model gives them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear


def test_this_torch_build_offers_onednn_so_the_cpu_path_is_taken():
    assert cpu_linear._ONEDNN is not None


@pytest.mark.parametrize("rows", [0, 1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_projection_gives_what_f_linear_gives(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g) * 0.05
    b = torch.randn(160, generator=g) if bias else None
    torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_strided_or_batched_input_and_other_dtypes_give_what_f_linear_gives():
    w = torch.randn(24, 16)
    x = torch.randn(16, 5).t()  # a column slice, not contiguous
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 16)
    torch.testing.assert_close(cpu_linear.linear(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-5)
    for dtype in (torch.bfloat16, torch.float64):
        xd, wd = x3.to(dtype), w.to(dtype)
        assert torch.equal(cpu_linear.linear(xd, wd), F.linear(xd, wd)), dtype
