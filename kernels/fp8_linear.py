"""FP8 weights: per-output-channel e4m3 weights, per-token dynamic e4m3 activations, one scaled matmul.

On a GPU, one token (batch-1 decode) takes the GEMV of kernels/gemv.py (weights four to a word, widened by
PTX) and batches of up to 16 tokens a Triton kernel: both read the FP8 weights, widen them in registers and
multiply with the activations as they are (no activation quantization: one launch, half the weight bytes of bf16, which is all a memory-bound step
pays for). A version that quantized the token and used the FP8 tensor cores measured slower (0.36-0.82 of the
copy ceiling against 0.45-0.66; docs/benchmarks.md). Larger batches (prefill) quantize the
activations per token and use torch._scaled_mm on the FP8 tensor cores. Elsewhere the weights are widened back
and multiplied in the activation dtype, so CPU tests check the quantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused import silu_and_mul
from kernels.gemv import gemv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (fp8 weight [out, in], float32 scale [out]) with w ~= fp8 * scale[:, None]."""
    amax = w.float().abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Linear(nn.Module):
    """A projection with e4m3 weights and a float32 scale per output row. Built empty (an FP8 checkpoint's
    tensors are loaded into it: engine/checkpoint_quant.py) or by `from_linear`, which quantizes one."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None = None, device=None):
        super().__init__()
        # Stored transposed ([in, out], column-major for the matmul), as _scaled_mm wants its second operand.
        self.register_buffer("weight_t", torch.empty(out_features, in_features, dtype=FP8, device=device).t())
        self.register_buffer("scale", torch.ones(1, out_features, dtype=torch.float32, device=device))
        self.bias = bias
        self.out_features, self.in_features = out_features, in_features
        # The one-token GEMV's counters when it splits K (kernels/gemv.py): one per block of >= 4 rows.
        self.register_buffer("counters", torch.zeros(-(-out_features // 4), dtype=torch.int32, device=device),
                             persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        q, scale = quantize_per_channel(linear.weight.data)
        m = cls(linear.in_features, linear.out_features, linear.bias, device=q.device)
        m.weight_t = q.t()
        m.scale = scale[None, :].contiguous()
        return m

    @property
    def weight_rows(self) -> torch.Tensor:
        """The FP8 weight as [out, in] (a view)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor, glu: bool = False, norm=None,
                residual: torch.Tensor | None = None, rope=None, squares=None, next_norm=None) -> torch.Tensor:
        """glu=True: silu(gate) * up of the output's halves (fused into the one-token kernel); `norm` (an
        RMSNorm), `residual` and `rope`: the one-token paths, as engine.model.Linear takes them."""
        if norm is not None or residual is not None or rope is not None:
            return gemv(x, self.weight_t.t(), self.scale.view(-1), self.bias, glu=glu,
                        norm=None if norm is None else (norm.weight, norm.eps), residual=residual,
                        counters=self.counters, rope=rope, squares=squares,
                        next_norm=None if next_norm is None else next_norm.weight)
        if x.shape[0] == 1 and x.is_cuda and triton is not None:
            return gemv(x, self.weight_t.t(), self.scale.view(-1), self.bias, glu=glu, counters=self.counters)
        y = self._matmul(x)
        return silu_and_mul(y) if glu else y

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.shape[0] <= SMALL_M and triton is not None:
            return fp8_weight_matmul(x, self.weight_t.t(), self.scale.view(-1), self.bias)
        # _scaled_mm wants both sizes a multiple of 16 (a vocabulary may not be): those widen the weights.
        if not x.is_cuda or self.out_features % 16 or self.in_features % 16:
            w = self.weight_t.t().to(x.dtype) * self.scale.t().to(x.dtype)
            return F.linear(x, w, self.bias)
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
        x_scale = amax / FP8_MAX
        xq = (x / x_scale.to(x.dtype)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out = torch._scaled_mm(xq, self.weight_t, scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype,
                               use_fast_accum=True)
        return out if self.bias is None else out + self.bias


SMALL_M = 16  # batches up to this many tokens use the weight-only kernel


def fp8_weight_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16) times FP8 w [N, K] (row-major) with per-row scale [N], + bias: [M, N] in x's dtype.
    One row goes to the GEMV (kernels/gemv.py): the tensor-core kernel below pads it to sixteen and measured
    0.59x as fast over the 8B step (benchmarks.md, run P)."""
    m, k = x.shape
    n = w.shape[0]
    if m > SMALL_M or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"fp8_weight_matmul: x {tuple(x.shape)}, w {tuple(w.shape)} strides {w.stride()}")
    if m == 1:  # one token: a plain multiply-and-reduce (no padding of one row to sixteen)
        return gemv(x, w, scale, bias, counters=counters)
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    args = (x, w, scale, bias if bias is not None else scale, out, m, n, k, w.stride(0))
    if x.is_cuda:
        # A fixed configuration (not a timed one): the same summation order in every process.
        _fp8_weight_kernel[grid](*args, HAS_BIAS=bias is not None, BLOCK_N=16, BLOCK_K=256, num_warps=4,
                                 num_stages=4)
    else:  # the interpreter (tests): one small configuration, no timing runs
        _fp8_weight_kernel[grid](*args, HAS_BIAS=bias is not None, BLOCK_N=16, BLOCK_K=64)
    return out


if triton is not None:
    @triton.jit
    def _fp8_weight_kernel(X, W, SCALE, BIAS, OUT, M, N, K, stride_wn, HAS_BIAS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rm = tl.arange(0, 16)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(X + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(W + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
                        mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        acc = acc * tl.load(SCALE + rn, mask=rn < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + rm[:, None] * N + rn[None, :], acc.to(OUT.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))



def quantize_model(model: nn.Module, lm_head: bool = False) -> int:
    """Swap every linear of the decoder layers for an Fp8Linear; returns how many. The LM head too with
    `lm_head`: 7 % of what the 8B bf16 step reads, 13 % of what its FP8 step reads. A head
    tied to the embedding table gets an FP8 copy of the table (the lookup keeps the original)."""
    count = 0
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Fp8Linear.from_linear(child))
                    count += 1
    if lm_head:
        head = getattr(model, "lm_head", None)
        if head is None:  # tied
            head = nn.Linear(model.embed_tokens.weight.shape[1], model.embed_tokens.weight.shape[0], bias=False,
                             device="meta")
            head.weight = model.embed_tokens.weight
        model.lm_head = Fp8Linear.from_linear(head)
        count += 1
    return count
