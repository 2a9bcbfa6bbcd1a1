"""Per-layer KV scales for FP8 pools, bounded from the weights.

An e4m3 pool holds magnitudes up to 448. Most models' K and V stay far below that, but not all: a large
q/k/v bias (Qwen2 has biases of several hundred on some K channels) or a large norm weight pushes channels
past it, and a pool stored at scale 1.0 then saturates them, which moves every score of that head.

The scales here are worst cases taken from the weights, not statistics of a calibration run. The input of
qkv_proj is RMSNorm(x) * g with RMSNorm(x) of norm at most sqrt(hidden), so by Cauchy-Schwarz each output
row j obeys |y_j| <= sqrt(hidden) * ||W_j * g|| + |b_j|. Rope rotates the pair (j, j + D/2) of a head, so
after it either element is at most the pair's Euclidean bound. With per-head q/k norms (Qwen3) the K bound
is sqrt(D) * |g_k| instead. No token can then exceed the bound, and because the scales depend only on the
weights, a prefill worker and a decode worker of one model compute the same ones without talking (the
registry's KVLayout carries them, so mismatched pools are never paired).

A scale is the power of two that maps the bound just inside the format's range: dividing by it and
multiplying back are exact, and values far below the bound keep e4m3's relative precision (three mantissa
bits, about 2.6 % of a vector's norm, whatever the scale; docs/benchmarks.md, Z64) until they reach its
subnormals, 2^-6 of the scale.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# Rounding of the bf16 activations on the way (the norm's output, the projection's) may put a value a few
# units of bf16's last place above the exact bound.
_MARGIN = 1.0 + 2.0 ** -5


def _dense(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in] in float32, bias or None) of a Linear or an Fp8Linear."""
    if hasattr(linear, "weight_t"):  # kernels.fp8_linear.Fp8Linear: fp8 [in, out] and a scale per output
        w = linear.weight_t.t().float() * linear.scale.float().view(-1, 1)
    else:
        w = linear.weight.float()
    return w, None if linear.bias is None else linear.bias.float()


@torch.no_grad()
def kv_bounds(model) -> tuple[list[float], list[float]]:
    """Per layer, bounds on |k| (after rope) and |v| of any token, over all ranks of a tensor-parallel group."""
    c = model.config  # this rank's share of the heads
    heads, dim = c.num_key_value_heads, c.head_dim
    k_bounds, v_bounds = [], []
    for layer in model.layers:
        attn = layer.self_attn
        w, bias = _dense(attn.qkv_proj)
        rows = (w * layer.input_layernorm.weight.float()).norm(dim=1) * math.sqrt(c.hidden_size)
        if bias is not None:
            rows += bias.abs()
        k = rows[c.q_size: c.q_size + c.kv_size].view(heads, dim)
        v = rows[c.q_size + c.kv_size:]
        if c.qk_norm:  # a per-head RMSNorm puts each element at most sqrt(D) * |its weight|
            k = attn.k_norm.weight.float().abs().expand(heads, dim) * math.sqrt(dim)
        half = dim // 2
        pairs = torch.sqrt(k[:, :half] ** 2 + k[:, half:] ** 2)
        k_bounds.append(pairs.max().item())
        v_bounds.append(v.max().item())
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:
        both = torch.tensor([k_bounds, v_bounds], dtype=torch.float32, device=w.device)
        tp.all_reduce(both, op=dist.ReduceOp.MAX)
        k_bounds, v_bounds = both.tolist()
    return k_bounds, v_bounds


def scale_for(bound: float, dtype: torch.dtype) -> float:
    """The power of two s with bound / s within the format's range and bound / s > range / 2 (1.0 for
    dtypes that need no scale, or a bound of zero)."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not bound > 0 or not math.isfinite(bound):
        return 1.0
    return 2.0 ** math.ceil(math.log2(bound * _MARGIN / torch.finfo(dtype).max))


def kv_scales(model, dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Per-layer (K scales, V scales) for a pool of `dtype` holding this model's KV."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        n = len(model.layers)
        return [1.0] * n, [1.0] * n
    k_bounds, v_bounds = kv_bounds(model)
    return [scale_for(b, dtype) for b in k_bounds], [scale_for(b, dtype) for b in v_bounds]
