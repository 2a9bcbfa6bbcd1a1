"""Rotary embedding fused with the KV store: one kernel per layer instead of about six.

Unfused, a layer's rope is a roll, two multiplies and an add over q and k, and the store is a stack and a
scatter into the pool; at batch 1 each of those is a launch that moves a few kilobytes. The fused kernel
reads the new q, k and v once, rotates q and k, writes q for attention and k, v straight into their pool
slots, divided by the layer's K and V scales (kvstore/pool.py) and saturated to the pool's FP8 range when
the pool is FP8.

Rope layout is the half-split one (rotate_half): out = x * cos + rotate_half(x) * sin. The tables come from
`Rotary.lookup`: cos [N, 1, D] and a signed sin whose first half is negated, so that the reference is
x * cos + roll(x, D/2) * sin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import pdl

try:
    import triton
    import triton.language as tl

    from kernels.pdl import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU installs without triton
    triton = None


@dataclass
class RopeTarget:
    """Where one token's qkv projection puts its rows when rope and the KV store fold into its GEMV
    (kernels/gemv.py, rope=): the token's rows of the rope tables, the layer's pool and the token's slot."""

    cos: torch.Tensor  # [D]: the token's row of Rotary.lookup's cos
    sin: torch.Tensor  # [D]: the same of its signed sin
    kv: torch.Tensor  # [P, 2, page, Hkv, D], any strides (the pool's layer view)
    page: torch.Tensor  # [1]
    slot: torch.Tensor  # [1]
    num_q_heads: int
    k_scale: float = 1.0  # the layer's scales in the pool (kvstore/pool.py)
    v_scale: float = 1.0


def apply_rope_ref(cos_sin, x: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated, as transformers computes it (in x's dtype)."""
    cos, sin = cos_sin
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def use_fused(x: torch.Tensor, fused: bool | None) -> bool:
    """fused=None: the kernel on a GPU, the reference elsewhere; True forces it (interpreter tests)."""
    half = x.shape[-1] // 2
    if triton is None or fused is False or half & (half - 1):
        return False
    return bool(fused) or x.is_cuda


def rope_store(qk: torch.Tensor, v: torch.Tensor, cos_sin, kv_layer: torch.Tensor, out_pages: torch.Tensor,
               out_offsets: torch.Tensor, num_q_heads: int, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
    """qk [N, Hq+Hkv, D] (unrotated; any token stride), v [N, Hkv, D]; kv_layer [P, 2, page, Hkv, D].
    Rotates q and k, stores k / k_scale and v / v_scale at (out_pages, out_offsets); returns the rotated q
    [N, Hq, D]."""
    n, heads, dim = qk.shape
    kv_heads = heads - num_q_heads
    q = torch.empty(n, num_q_heads, dim, dtype=qk.dtype, device=qk.device)
    if n == 0:
        return q
    cos, sin = cos_sin
    cos, sin = cos.reshape(n, dim), sin.reshape(n, dim)
    fp8 = kv_layer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    limit = torch.finfo(kv_layer.dtype).max if fp8 else 0.0
    block_h = triton.next_power_of_2(max(num_q_heads, kv_heads))
    on = pdl.enabled(qk)
    _rope_store_kernel[(n,)](
        qk, v, cos, sin, q, kv_layer, out_pages, out_offsets,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        limit, 1.0 / k_scale, 1.0 / v_scale,
        HQ=num_q_heads, HKV=kv_heads, BLOCK_H=block_h, HALF=dim // 2, FP8=fp8, PDL=on, launch_pdl=on,
        num_warps=4 if block_h * dim <= 4096 else 8,
    )
    return q


if triton is not None:
    @triton.jit
    def _rope_store_kernel(QK, V, COS, SIN, Q_OUT, KV, pages, offsets,
                           s_qk_t, s_qk_h, s_v_t, s_v_h, s_cos, s_sin, s_q_t, s_q_h,
                           s_kv_p, s_kv_kv, s_kv_s, s_kv_h, limit, k_inv, v_inv,
                           HQ: tl.constexpr, HKV: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                           FP8: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HALF)
        # The tables hold cos for both halves and sin with its first half negated: use the second halves.
        # They and the slots are written at the start of the step, long before the previous kernel.
        c = tl.load(COS + t * s_cos + HALF + d).to(tl.float32)[None, :]
        s = tl.load(SIN + t * s_sin + HALF + d).to(tl.float32)[None, :]
        page = tl.load(pages + t).to(tl.int64)
        slot = tl.load(offsets + t).to(tl.int64)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

        qmask = (h < HQ)[:, None]
        base = QK + t * s_qk_t + h[:, None] * s_qk_h + d[None, :]
        x1 = tl.load(base, mask=qmask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=qmask, other=0.0).to(tl.float32)
        out = Q_OUT + t * s_q_t + h[:, None] * s_q_h + d[None, :]
        tl.store(out, (x1 * c - x2 * s).to(Q_OUT.dtype.element_ty), mask=qmask)
        tl.store(out + HALF, (x2 * c + x1 * s).to(Q_OUT.dtype.element_ty), mask=qmask)

        kmask = (h < HKV)[:, None]
        kbase = QK + t * s_qk_t + (HQ + h[:, None]) * s_qk_h + d[None, :]
        k1 = tl.load(kbase, mask=kmask, other=0.0).to(tl.float32)
        k2 = tl.load(kbase + HALF, mask=kmask, other=0.0).to(tl.float32)
        # k is rounded to the activation dtype first, as it is when the pool holds that dtype or FP8 is cast from it.
        # The scales are powers of two: the products are exact.
        r1 = (k1 * c - k2 * s).to(QK.dtype.element_ty).to(tl.float32) * k_inv
        r2 = (k2 * c + k1 * s).to(QK.dtype.element_ty).to(tl.float32) * k_inv
        vbase = V + t * s_v_t + h[:, None] * s_v_h + d[None, :]
        v1 = tl.load(vbase, mask=kmask, other=0.0).to(tl.float32) * v_inv
        v2 = tl.load(vbase + HALF, mask=kmask, other=0.0).to(tl.float32) * v_inv
        if FP8:
            r1 = tl.clamp(r1, -limit, limit)
            r2 = tl.clamp(r2, -limit, limit)
            v1 = tl.clamp(v1, -limit, limit)
            v2 = tl.clamp(v2, -limit, limit)
        kdst = KV + page * s_kv_p + slot * s_kv_s + h[:, None] * s_kv_h + d[None, :]
        ty = KV.dtype.element_ty
        tl.store(kdst, r1.to(ty), mask=kmask)
        tl.store(kdst + HALF, r2.to(ty), mask=kmask)
        tl.store(kdst + s_kv_kv, v1.to(ty), mask=kmask)
        tl.store(kdst + s_kv_kv + HALF, v2.to(ty), mask=kmask)
