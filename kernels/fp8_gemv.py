"""One token times FP8 weights on the FP8 tensor cores: y = (W_fp8 q(act(x))) * x_scale * w_scale + bias.

Widening FP8 weights to float in registers (kernels/gemv.py) costs two conversions per weight byte, and at
batch 1 that conversion work, not the memory, bounds the kernel (about 0.5-0.65 of the copy ceiling on an
H200). Here the token is quantized instead: each program takes the token's absolute maximum (one dynamic
e4m3 scale per token, as the prefill path's torch._scaled_mm uses), quantizes its K slices once, and feeds
the weight tiles to the tensor cores as they are loaded. The one token is broadcast to the 16 rows an MMA
needs; every row then holds the same sums, and any one of them is the answer.

`act="silu_mul"` takes x as [1, 2K] (gate, up) and uses silu(gate) * up, rounded as the separate kernel
rounds it.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.gemv import ACTS

try:
    import triton
    import triton.language as tl

    from kernels.gemv import _load_x
    from kernels.pdl import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU installs without triton
    triton = None

FP8_MAX = 448.0  # e4m3fn


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             act: str | None = None, launch: tuple | None = None) -> torch.Tensor:
    """act(x) [1, K] (bf16/fp16/fp32) times FP8 w [N, K] (row-major) with per-row float32 scale [N], + bias:
    [1, N] in x's dtype. `launch` = (BLOCK_N, BLOCK_K, warps, stages) overrides the fixed choice."""
    n, k = w.shape
    width = 2 * k if act == "silu_mul" else k
    if act not in ACTS or x.shape != (1, width) or w.stride(1) != 1 or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype} strides {w.stride()}, "
                         f"act {act!r}")
    x = x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    # A fixed configuration (never a timed one): the same summation order in every process.
    bn, bk, warps, stages = launch or ((32, 256, 4, 3) if x.is_cuda else (16, 64, 4, 1))
    on = pdl.enabled(x)
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x, w, scale, bias if bias is not None else scale, out, n, k, w.stride(0), FP8_MAX,
        HAS_BIAS=bias is not None, ACT=ACTS[act], PDL=on, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages, **(dict(launch_pdl=on) if x.is_cuda else {}))
    return out


if triton is not None:
    @triton.jit
    def _fp8_gemv_kernel(X, W, SCALE, BIAS, OUT, N, K, stride_wn, fp8_max, HAS_BIAS: tl.constexpr,
                         ACT: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_scale = tl.load(SCALE + rn, mask=rn < N, other=0.0)  # a weight: read before the wait
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        # The token's scale: its absolute maximum over all of K (each program reads the token from L2).
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(_load_x(X, k0 + rk, K, ACT)))
        x_scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / fp8_max
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        rows = W + rn[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            xq = tl.clamp(_load_x(X, kk, K, ACT) / x_scale, -fp8_max, fp8_max).to(W.dtype.element_ty)
            w = tl.load(rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(tl.broadcast_to(xq[None, :], (16, BLOCK_K)), tl.trans(w), acc)
        y = tl.max(acc, axis=0) * x_scale * w_scale  # the 16 rows are equal: max picks one exactly
        if HAS_BIAS:
            y += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(OUT + rn, y.to(OUT.dtype.element_ty), mask=rn < N)
