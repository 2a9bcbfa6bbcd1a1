"""One token times a weight matrix, in one kernel: y = (W act(x)) * scale + bias for W [N, K] in bf16/fp16 or FP8.

At batch 1 a decode step is weight reads and little else, and inside a CUDA graph every extra kernel costs a
launch gap. cuBLAS splits K for projections narrower than their input (o_proj, down_proj) and adds a reduction
kernel; this kernel gives each program a few output rows and long K slices, with few warps, so that many small
programs are in flight per SM and hide the memory latency of the K loop. Launched with PDL (kernels/pdl.py), a
program loads its first weight tile before it waits for the previous kernel, so the weight stream starts
while the previous kernel drains. FP8 weights are widened in registers (with their per-row scale), so the
same kernel reads half the bytes for `--quantization fp8`.

`act="silu_mul"` takes x as [1, 2K] (gate, up) and multiplies by silu(gate) * up, rounded as the separate
kernel rounds it: down_proj and its activation in one launch.

The residual stream can fold into the projections on either side of it, so that a layer has no norm kernels
of its own: `norm=(weight, eps)` takes x as the residual stream and projects rmsnorm(x) * weight (the norm's scale is
gathered in the K loop and applied to the finished rows; the normed token is never rounded to bf16 on the
way, so this is a little more exact than the separate norm kernel), and `residual=r`
adds the projection to r in place (rounded to r's dtype, as the separate add is) and returns r.
"""

from __future__ import annotations

import functools

import torch

from kernels import pdl

try:
    import triton
    import triton.language as tl

    from kernels.pdl import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU installs without triton
    triton = None

ACTS = {None: 0, "silu_mul": 1}


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, act: str | None = None, launch: tuple | None = None,
         norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x) [1, K] times w [N, K] (row-major), times scale [N] if given, plus bias [N]: [1, N] in x's dtype.
    `norm` and `residual`: see the module's docstring. `launch` overrides config() (bench/gpu.py --tune-gemv)."""
    n, k = w.shape
    width = 2 * k if act == "silu_mul" else k
    if act not in ACTS or x.shape != (1, width) or w.stride(1) != 1 or (act and norm):
        raise ValueError(f"gemv: x {tuple(x.shape)}, w {tuple(w.shape)} strides {w.stride()}, act {act!r}, "
                         f"norm {norm is not None}")
    if residual is not None and (residual.shape != (1, n) or not residual.is_contiguous()):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} for an output of {n}")
    x = x.contiguous()
    out = residual if residual is not None else torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    norm_w, eps = norm if norm is not None else (w, 0.0)
    args = (x, w, scale if scale is not None else w, bias if bias is not None else w, norm_w, out, n, k,
            w.stride(0), eps)
    flags = dict(HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, ACT=2 if norm is not None else ACTS[act],
                 ADD_TO_OUT=residual is not None)
    if x.is_cuda:
        on = pdl.enabled(x)
        bn, bk, warps, stages = launch or config(n, k, x.device, w.element_size(), norm is not None)
        _gemv_kernel[grid](*args, **flags, PDL=on, launch_pdl=on, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                           num_stages=stages)
    else:  # the interpreter (tests): one small configuration
        _gemv_kernel[grid](*args, **flags, PDL=False, BLOCK_N=16, BLOCK_K=64)
    return out


@functools.lru_cache(maxsize=None)
def config(n: int, k: int, device: torch.device, element_size: int = 2,
           norm: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for an [n, k] weight: a fixed choice, never a timed one, so that every
    process computes a projection with the same summation order and greedy tokens agree across workers (a
    prefill and a decode worker, or two replicas). The choices are the best or near-best of
    `python -m bench.gpu --tune-gemv` on an H200 for the 8B shapes (docs/benchmarks.md). A folded norm
    (`norm`) costs each program work per token element, so it gets programs of at least eight rows."""
    if element_size == 1:  # FP8: long K slices for long rows (down_proj), else eight rows of 512
        return (4, 2048, 4, 2) if k >= 8192 else (8, 512, 2, 3)
    if k >= 4096 and n >= 4 * k and not norm:  # gate_up: 0.98 of the copy ceiling against 0.96
        return 2, 2048, 2, 2
    if k >= 4096 and n > k:  # qkv: 0.85 against 0.78
        return 16, 512, 4, 3
    return 8, 1024, 4, 2


if triton is not None:
    @triton.jit
    def _load_x(X, kk, K, ACT: tl.constexpr):
        if ACT == 1:  # silu(gate) * up, each product rounded to the activation dtype as silu_and_mul does
            g = tl.load(X + kk, mask=kk < K, other=0.0)
            u = tl.load(X + K + kk, mask=kk < K, other=0.0)
            gf = g.to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(u.dtype)
            return (s * u).to(tl.float32)
        return tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)

    @triton.jit
    def _gemv_kernel(X, W, SCALE, BIAS, NW, OUT, N, K, stride_wn, eps, HAS_SCALE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ADD_TO_OUT: tl.constexpr,
                     PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rows = W + rn[:, None].to(tl.int64) * stride_wn
        nmask = rn[:, None] < N
        # The first weight tile is loaded before the wait: no kernel of the step writes weights.
        w = tl.load(rows + rk[None, :], mask=nmask & (rk[None, :] < K), other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = _load_x(X, k0 + rk, K, ACT)
            if ACT == 2:
                # rmsnorm's scale is one number for the whole token: gather its sum of squares on the way and
                # apply it to the finished rows, so the token is read once, in the slices the loop reads anyway.
                sq += x * x
                x = x * tl.load(NW + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            nk = k0 + BLOCK_K + rk
            w_next = tl.load(rows + nk[None, :], mask=nmask & (nk[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            w = w_next
        y = tl.sum(acc, axis=1)
        if ACT == 2:
            y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        if HAS_SCALE:
            y = y * tl.load(SCALE + rn, mask=rn < N, other=0.0)
        if HAS_BIAS:
            y += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = y.to(OUT.dtype.element_ty)
        if ADD_TO_OUT:
            # The residual add, rounded to the stream's dtype as the separate add is. Each program reads and
            # writes only its own rows, so updating in place is safe.
            r = tl.load(OUT + rn, mask=rn < N, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(OUT.dtype.element_ty)
        tl.store(OUT + rn, y, mask=rn < N)
