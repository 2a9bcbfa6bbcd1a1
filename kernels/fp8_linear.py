"""FP8 weights: per-output-channel e4m3 weights, per-token dynamic e4m3 activations, one scaled matmul.

On a GPU the product is torch._scaled_mm (FP8 tensor cores; half the weight bytes of bf16, which is what a
memory-bound decode step pays for). Elsewhere the weights are widened back and multiplied in the activation
dtype, which gives the same numbers up to the activation rounding, so CPU tests check the quantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (fp8 weight [out, in], float32 scale [out]) with w ~= fp8 * scale[:, None]."""
    amax = w.float().abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_per_channel(linear.weight.data)
        # Stored transposed ([in, out], column-major for the matmul), as _scaled_mm wants its second operand.
        self.register_buffer("weight_t", q.t())
        self.register_buffer("scale", scale[None, :].contiguous())
        self.bias = linear.bias
        self.out_features, self.in_features = linear.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            w = self.weight_t.t().to(x.dtype) * self.scale.t().to(x.dtype)
            return F.linear(x, w, self.bias)
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
        x_scale = amax / FP8_MAX
        xq = (x / x_scale.to(x.dtype)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out = torch._scaled_mm(xq, self.weight_t, scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype,
                               use_fast_accum=True)
        return out if self.bias is None else out + self.bias


def quantize_model(model: nn.Module) -> int:
    """Swap every linear of the decoder layers (not the LM head) for an Fp8Linear; returns how many."""
    count = 0
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Fp8Linear(child))
                    count += 1
    return count
