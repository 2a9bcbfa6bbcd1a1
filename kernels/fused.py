"""Fused elementwise kernels for the GPU: residual-add + RMSNorm, and SiLU-and-mul.

At batch 1 a decode step is a few hundred tiny kernels, and inside a CUDA graph each still costs a couple of
microseconds; these fusions take a layer from about thirty kernels to about fifteen. On a CPU (or without
Triton) the same functions run the torch reference, operation for operation as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import pdl

try:
    import triton
    import triton.language as tl

    from kernels.pdl import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU installs without triton
    triton = None


def _use_triton(x: torch.Tensor, fused: bool | None) -> bool:
    """fused=None: the kernel on a GPU, the reference elsewhere; True forces the kernel (interpreter tests)."""
    if triton is None or fused is False:
        return False
    return bool(fused) or x.is_cuda


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); without a residual, x itself is the residual."""
    if _use_triton(x, fused) and x.is_contiguous() and x.dim() == 2:
        out = torch.empty_like(x)
        res_out = torch.empty_like(x) if residual is not None else x
        n = x.shape[-1]
        on = pdl.enabled(x)
        _add_rmsnorm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, res_out, weight, out, n, eps,
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), PDL=on, launch_pdl=on,
            num_warps=4 if n <= 4096 else 8)
        return out, res_out
    if residual is not None:
        x = x + residual
    return rms_norm_ref(x, weight, eps), x


def silu_and_mul(x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [N, 2d]."""
    d = x.shape[-1] // 2
    if _use_triton(x, fused) and x.is_contiguous() and x.dim() == 2:
        out = torch.empty(x.shape[0], d, dtype=x.dtype, device=x.device)
        block = 1024
        on = pdl.enabled(x)
        _silu_mul_kernel[(x.shape[0], triton.cdiv(d, block))](x, out, d, BLOCK=block, PDL=on, launch_pdl=on,
                                                               num_warps=4)
        return out
    gate, up = x.split(d, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _add_rmsnorm_kernel(X, R, R_OUT, W, OUT, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0)  # a weight: safe to read before the wait
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        x = tl.load(X + row * N + cols, mask=mask, other=0.0)
        if HAS_RES:
            # The residual stream keeps the activation dtype, as an unfused add would.
            x = (x.to(tl.float32) + tl.load(R + row * N + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(R_OUT.dtype.element_ty)
            tl.store(R_OUT + row * N + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        y = w * (xf * rstd).to(OUT.dtype.element_ty)
        tl.store(OUT + row * N + cols, y, mask=mask)

    @triton.jit
    def _silu_mul_kernel(X, OUT, D, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        g = tl.load(X + row * 2 * D + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * 2 * D + D + cols, mask=mask, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
        tl.store(OUT + row * D + cols, s * u, mask=mask)
