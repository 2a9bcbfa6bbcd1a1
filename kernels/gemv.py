"""One token times a weight matrix, in one kernel: y = (W x) * scale + bias for W [N, K] in bf16/fp16 or FP8.

cuBLAS is excellent for wide outputs, but for projections narrower than their input (o_proj, down_proj) it
splits K at batch 1 and adds a reduction kernel; inside a decode graph every extra kernel costs a launch gap.
This kernel gives each program a few output rows and long K slices, with few warps, so that many small
programs are in flight per SM and hide the memory latency of the K loop. FP8 weights are widened in registers
(with their per-row scale), so the same kernel reads half the bytes for `--quantization fp8`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    import triton.testing
except ImportError:  # CPU installs without triton
    triton = None


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] times w [N, K] (row-major), times scale [N] if given, plus bias [N]: [1, N] in x's dtype."""
    n, k = w.shape
    if x.shape != (1, k) or w.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)}, w {tuple(w.shape)} strides {w.stride()}")
    x = x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    args = (x, w, scale if scale is not None else w, bias if bias is not None else w, out, n, k, w.stride(0))
    flags = dict(HAS_SCALE=scale is not None, HAS_BIAS=bias is not None)
    if x.is_cuda:
        _gemv_tuned[grid](*args, **flags)
    else:  # the interpreter (tests): one small configuration, no timing runs
        _gemv_kernel[grid](*args, **flags, BLOCK_N=16, BLOCK_K=64)
    return out


if triton is not None:
    def _bench(fn, quantiles=None, **_):
        # Time candidates inside a CUDA graph: these kernels take microseconds, less than a launch from Python,
        # and timing plain launches would rank the launch overhead instead of the kernels.
        return triton.testing.do_bench_cudagraph(fn, rep=20, quantiles=quantiles)

    def autotune_in_graph(configs, kernel):
        return triton.autotune(configs=configs, key=["N", "K"], do_bench=_bench)(kernel)

    @triton.jit
    def _gemv_kernel(X, W, SCALE, BIAS, OUT, N, K, stride_wn, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
            w = tl.load(W + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
                        mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_SCALE:
            y = y * tl.load(SCALE + rn, mask=rn < N, other=0.0)
        if HAS_BIAS:
            y += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(OUT + rn, y.to(OUT.dtype.element_ty), mask=rn < N)

    _GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                     for bn, bk, w, s in [(2, 2048, 2, 2), (4, 1024, 2, 2), (8, 1024, 4, 2), (8, 512, 2, 3),
                                          (16, 512, 4, 3)]]
    _gemv_tuned = autotune_in_graph(_GEMV_CONFIGS, _gemv_kernel)
