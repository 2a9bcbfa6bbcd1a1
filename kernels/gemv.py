"""One token times a weight matrix, in one kernel: y = (W x) * scale + bias for W [N, K] in bf16/fp16 or FP8.

At batch 1 a decode step is weight reads and little else, and inside a CUDA graph every extra kernel costs a
launch gap. cuBLAS splits K for projections narrower than their input (o_proj, down_proj) and adds a reduction
kernel; this kernel gives each program a few output rows and long K slices, with few warps, so that many small
programs are in flight per SM and hide the memory latency of the K loop. Launched with PDL (kernels/pdl.py), a
program loads its first weight tile before it waits for the previous kernel, so the weight stream starts
while the previous kernel drains. FP8 weights are widened in registers (with their per-row scale), so the
same kernel reads half the bytes for `--quantization fp8`; e4m3 weights are read four to a 32-bit word and
widened by PTX (`_gemv_e4m3_kernel`).

A projection narrower than its input (o_proj, down_proj) has few rows to hand out, and programs of few rows
each load the token once per row they own. The e4m3 kernel can split K instead (the fifth number of a
launch): tall programs that share each token load among many rows, each over a slice of K, write partial rows
to a workspace; the last program of a row block to arrive (a counter per block, which it resets) adds the
partials in split order and finishes the rows. The sum's order is fixed by the launch, not by which program
arrives last, so results stay deterministic. Or it keeps two weight tiles in flight (the sixth number): with
about four programs per SM, one 8 KB tile each leaves the memory idle between tiles.

`glu=True` is gate_up_proj and its activation in one launch: W's rows are the gate half and then the up half,
each program takes matching rows of both (gate and up alternating), and the output is silu(gate) * up, [1, N/2],
rounded as the separate projection and activation kernels round it. The activation is computed once per
element where the result is made; done where down_proj reads its input instead, every program of down_proj
recomputed it for its K slice (and read twice the input).

The residual stream can fold into the projections on either side of it, so that a layer has no norm kernels
of its own: `norm=(weight, eps)` takes x as the residual stream and projects rmsnorm(x) * weight (the norm's scale is
gathered in the K loop and applied to the finished rows; the normed token is never rounded to bf16 on the
way, so this is a little more exact than the separate norm kernel), and `residual=r`
adds the projection to r in place (rounded to r's dtype, as the separate add is) and returns r. With
`squares=TokenSquares`, the residual add also leaves each program's sum of squares of the rows it updated, and
the next norm takes its scale from them instead of gathering it in the K loop: it loads and adds them after
the loop, and the K loop does no work for the norm but the multiply by its weight (0.5B step 0.666 against
0.706 ms in run Z7b, 0.700 against 0.703 in Z8). (Requested before the loop, they were held in registers
through it: the FP8 8B gate_up then took 80 registers against the plain GEMV's 72, six programs per SM
against seven, and its 896 programs no longer fit in one wave on 132 SMs.) Given `next_norm=weight` as well, the residual add leaves the updated stream times that
weight in `squares.token`, and the GEMV that folds that norm reads the token in place of the stream: its K
loop then does no work for the norm at all. The multiply in the K loop ran in every program, once per weight
element it met; here it runs once per element of the stream. A token in the stream's dtype adds one rounding
(of x * weight, where the separate norm kernel rounds its output); a float32 token gives the K loop's numbers
exactly.

`rope=RopeTarget` (one-token steps, unless PDSERVE_FUSE_ROPE=0) folds kernels/rope.py's rope_store into qkv_proj: the
rows of each head pair d with d + D/2, and the finished pairs are rotated and stored as rope_store stores
them, q into the returned [1, Hq, D] and k, v into the token's pool slot. A layer then has no rope kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import pdl
from kernels.rope import RopeTarget

try:
    import triton
    import triton.language as tl

    from kernels.pdl import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU installs without triton
    triton = None


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


@dataclass
class TokenSquares:
    """The residual stream's sum of squares, as `count` partial sums at the start of `buf` (float32): written
    by a GEMV that adds into the stream (`residual=`, one per program), read by the next one that folds a norm
    (`norm=`), which adds them. count is 0 until a GEMV has written them, or when that GEMV ran more programs
    than `buf` holds (at most 1024): the reader then gathers the sum from the token itself.

    `token` (the stream's width, in token_dtype, or None): the updated stream times the next norm's weight, written
    beside the stream by the same GEMV when it is given `next_norm=`; `token_norm` is that weight. A GEMV
    that folds this very norm then reads `token` instead of the stream, so its K loop does no per-element
    work for the norm at all (the weight multiply, done there, ran once per program for each element)."""
    buf: torch.Tensor
    count: int = 0
    token: torch.Tensor | None = None
    token_norm: torch.Tensor | None = None
    # With `arrivals` (one int32 zero): the last program of the adding GEMV adds the partial sums into buf[0]
    # and count is 1, so each program of the reader loads one number rather than count of them
    # (PDSERVE_NORM_SQUARES_SUMMED; off: the count and the serial sum cost more than the loads they save).
    summed: bool = False
    arrivals: torch.Tensor | None = None

    @staticmethod
    def new(device: torch.device, size: int = 1024, width: int = 0,
            token_dtype: torch.dtype = torch.float32, summed: bool = False) -> "TokenSquares":
        token = torch.empty(width, dtype=token_dtype, device=device) if width else None
        arrivals = torch.zeros(1, dtype=torch.int32, device=device) if summed else None
        return TokenSquares(torch.empty(size, dtype=torch.float32, device=device), token=token, summed=summed,
                            arrivals=arrivals)


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, glu: bool = False, launch: tuple | None = None,
         norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
         counters: torch.Tensor | None = None, rope: RopeTarget | None = None,
         squares: TokenSquares | None = None, out_dtype: torch.dtype | None = None,
         next_norm: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] times w [N, K] (row-major), times scale [N] if given, plus bias [N]: [1, N] in x's dtype (or
    out_dtype: float32 logits are stored as summed, never rounded to x's dtype on the way), or
    with `glu` silu(first half) * (second half), [1, N/2]. `norm` and `residual`: see the module's docstring.
    `launch` overrides config() (bench/gpu.py --tune-gemv). `counters`: int32 zeros, at least one per row
    block, for launches that split K (they are left at zero); without them a split launch allocates its own
    (one more kernel, a memset). `rope`: returns the rotated q [1, Hq, D] (see the module's docstring).
    `squares` (TokenSquares): with `residual`, each program also writes the sum of squares of the rows it
    updated; with `norm`, the norm's scale comes from the sums the last such GEMV wrote, not from x.
    `next_norm` (with `residual` and `squares`): also write squares.token, the updated stream times this
    weight, which a GEMV folding that norm reads in place of x."""
    n, k = w.shape
    paired = glu or rope is not None
    if (x.shape != (1, k) or w.stride(1) != 1 or (paired and (n % 2 or residual is not None)) or (glu and rope)
            or (out_dtype is not None and (paired or residual is not None))):
        raise ValueError(f"gemv: x {tuple(x.shape)}, w {tuple(w.shape)} strides {w.stride()}, glu {glu}, "
                         f"rope {rope is not None}, residual {residual is not None}")
    if residual is not None and (residual.shape != (1, n) or not residual.is_contiguous()):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} for an output of {n}")
    x = x.contiguous()
    if rope is not None:
        hq, hkv, dim = rope.num_q_heads, rope.kv.shape[3], rope.kv.shape[4]
        if n != (hq + 2 * hkv) * dim or dim % 2 or rope.cos.shape != (dim,) or rope.sin.shape != (dim,):
            raise ValueError(f"gemv: rope over {hq} + 2 x {hkv} heads of {dim} for {n} rows")
        out = torch.empty(1, hq, dim, dtype=x.dtype, device=x.device)
        fp8_kv = rope.kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        rope_args = (rope.cos, rope.sin, rope.kv, rope.page, rope.slot, *rope.kv.stride()[:4],
                     torch.finfo(rope.kv.dtype).max if fp8_kv else 0.0, 1.0 / rope.k_scale, 1.0 / rope.v_scale)
        rope_flags = dict(ROPE=True, HQ=hq, HKV=hkv, HALF=dim // 2, KV_FP8=fp8_kv)
    else:
        out = residual if residual is not None else torch.empty(1, n // 2 if glu else n, dtype=out_dtype or x.dtype,
                                                                device=x.device)
        rope_args = (w, w, w, w, w, 0, 0, 0, 0, 0.0, 1.0, 1.0)
        rope_flags = dict(ROPE=False, HQ=1, HKV=1, HALF=1, KV_FP8=False)
    e4m3 = w.dtype == torch.float8_e4m3fn and k % 4 == 0 and w.is_contiguous()
    if x.is_cuda:
        bn, bk, warps, stages, split, ahead = launch_of(launch or config(n, k, x.device, w.element_size(),
                                                                          norm is not None, glu))
    else:  # the interpreter (tests): small tiles, and the split of `launch` if one is given
        bn, bk, warps, stages = 16, 64, 4, 1
        split, ahead = launch_of(launch)[4:] if launch else (1, 1)
    if ahead not in (1, 2):
        raise ValueError(f"gemv: one or two weight tiles in flight, not {ahead}")
    if (split > 1 or ahead > 1) and not e4m3:
        if launch:
            raise ValueError(f"gemv: only e4m3 weights with K % 4 == 0 split K or load two tiles ahead "
                             f"(w {w.dtype}, K {k})")
        split = ahead = 1  # config()'s choice for words, which these weights cannot be read as
    blocks = triton.cdiv(n, bn)
    norm_w, eps = norm if norm is not None else (w, 0.0)
    sq_in = norm is not None and squares is not None and squares.count > 0
    # The token the previous GEMV left already scaled by this norm's weight: read in place of x.
    token_in = _reads_token(norm, squares)
    sq_out = residual is not None and squares is not None and blocks <= min(squares.buf.numel(), 1024)
    if squares is not None and (squares.buf.dtype != torch.float32 or squares.buf.device != x.device):
        raise ValueError(f"gemv: squares must be float32 on {x.device}")
    token_out = sq_out and next_norm is not None and squares.token is not None
    if token_out and (squares.token.shape != (n,) or next_norm.shape != (n,)):
        raise ValueError(f"gemv: squares.token and next_norm must be [{n}]")
    sq_one = sq_out and squares.summed
    if sq_one and (squares.arrivals is None or squares.arrivals.dtype != torch.int32):
        raise ValueError("gemv: summed squares need one int32 arrivals counter")
    if residual is not None and squares is not None:
        squares.count = (1 if sq_one else blocks) if sq_out else 0
        squares.token_norm = next_norm if token_out else None
    sq_buf = squares.buf if squares is not None else w
    args = (squares.token if token_in else x, w, scale if scale is not None else w, bias if bias is not None else w,
            norm_w, out, n, k, w.stride(0), eps, sq_buf,
            squares.count if sq_in else 0)
    tok_args = ((squares.token, next_norm) if token_out else (w, w)) + (squares.arrivals if sq_one else w,)
    if paired and bn < 2:
        raise ValueError(f"gemv: glu and rope need programs of at least two rows (a pair), launch {launch}")
    flags = dict(HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, NORM=norm is not None and not sq_in,
                 NORM_W=norm is not None and not token_in, SQ_IN=triton.next_power_of_2(squares.count) if sq_in else 0,
                 SQ_OUT=sq_out, TOKEN_OUT=token_out, SQ_ONE=sq_one,
                 SQ_BLOCK=triton.next_power_of_2(blocks) if sq_one else 1, GLU=glu,
                 ADD_TO_OUT=residual is not None, PDL=pdl.enabled(x) if x.is_cuda else False, BLOCK_N=bn,
                 BLOCK_K=bk, **rope_flags)
    opts = dict(launch_pdl=flags["PDL"], num_warps=warps, num_stages=stages) if x.is_cuda else {}
    if not e4m3:
        _gemv_kernel[(blocks,)](*args, *rope_args, *tok_args, **flags, **opts)
        return out
    # Four weights to a word (see _gemv_e4m3_kernel); widened by PTX on a GPU.
    if split > 1:
        if counters is None:
            counters = torch.zeros(blocks, dtype=torch.int32, device=x.device)
        if counters.dtype != torch.int32 or counters.numel() < blocks:
            raise ValueError(f"gemv: {blocks} int32 counters needed, got {counters.numel()} {counters.dtype}")
        work = torch.empty(split * (blocks * bn + 1), dtype=torch.float32, device=x.device)
    else:
        counters = work = w
    args = args[:1] + (w.view(torch.int32),) + args[2:8] + (w.stride(0) // 4, *args[9:], *rope_args, *tok_args, work, counters)
    even = n % bn == 0 and k % (bk * split) == 0  # (paired rows: n/2 pairs in programs of bn/2)
    _gemv_e4m3_kernel[(blocks, split)](*args, **flags, **opts, PTX=x.is_cuda, EVEN=even, SPLIT=split, AHEAD=ahead)
    return out


def _reads_token(norm, squares: TokenSquares | None) -> bool:
    return (norm is not None and squares is not None and squares.count > 0 and squares.token is not None
            and squares.token_norm is norm[0])


def launch_of(launch: tuple) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages, split, ahead): a launch of four numbers does not split K, and one of
    five keeps one weight tile in flight."""
    return tuple(launch) + (1,) * (6 - len(launch))


@functools.lru_cache(maxsize=None)
def config(n: int, k: int, device: torch.device, element_size: int = 2, norm: bool = False,
           glu: bool = False) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, warps, stages[, split]) for an [n, k] weight: a fixed choice, never a timed one, so
    that every process computes a projection with the same summation order and greedy tokens agree across
    workers (a prefill and a decode worker, or two replicas). The choices are the best or near-best of
    `python -m bench.gpu --tune-gemv` on an H200 for the 8B and 0.5B shapes (docs/benchmarks.md); FP8 ones
    were kept only where they led or came within 0.02 of the lead in two runs on different machines (runs R2
    and R3; gate_up: R6 and R7; gate_up with its activation: S1-S3). A folded norm (`norm`) costs each program
    work per token element, so it gets programs of at least eight rows."""
    if element_size == 1:  # FP8
        if n >= 4 * k and k >= 4096 and glu:  # 8B gate_up + SiLU: 0.89-0.91 against 0.80-0.83 (S1-S3)
            return 32, 256, 4, 3
        if n >= 16 * k and k >= 4096:  # the 8B LM head (--quantize-lm-head): 0.97 against 0.92 (run Z1)
            return 32, 512, 4, 2
        if n >= 4 * k:  # 0.5B gate_up (+ SiLU): 0.51-0.54 (runs R6, S1-S3)
            return 16, 512, 4, 3
        if k >= 4096 and n > k:  # 8B qkv: K split in four, 0.63-0.66 against 0.49-0.65 unsplit (runs R)
            return 32, 256, 4, 3, 4
        if k >= 4096:  # 8B o, down, two tiles in flight: 0.61-0.63, 0.80-0.81 against 0.57, 0.73 (Y2, Y4)
            return 8, 1024, 4, 2, 1, 2
        # 0.5B down 0.24-0.25 (S1-S3)
        return (4, 2048, 4, 2) if k >= 4 * n else (8, 1024, 4, 2)
    # gate_up + SiLU: 0.95-0.96 against 0.92-0.93 (S2, S3); folded, its norm's weight is in the token it reads
    if k >= 4096 and n >= 4 * k and glu:
        return 8, 1024, 4, 2
    if k >= 4096 and n >= 4 * k and not norm:  # gate_up alone: 0.98 of the copy ceiling against 0.96
        return 2, 2048, 2, 2
    if k >= 4096 and n > k:  # qkv: 0.85 against 0.78
        return 16, 512, 4, 3
    if n >= 4 * k and k < 4096 and glu and norm:  # 0.5B gate_up + SiLU, norm folded: its step 0.586 ms against 0.640 (Z11)
        return 16, 256, 4, 3
    if n >= 4 * k and not norm:  # 0.5B gate_up: 0.66 against 0.59 (run Q)
        return 32, 256, 4, 3
    if k >= 4 * n and not norm:  # 0.5B down: 0.52 against 0.43-0.44 for (4, 2048, 4, 2) (runs S3, T)
        return 2, 4096, 2, 1
    return 8, 1024, 4, 2


if triton is not None:
    @triton.jit
    def _rows(pid, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr):
        """The weight rows of program pid. With GLU, gate and up rows alternate: the program's BLOCK_N // 2
        outputs are rows i of the gate half and i + N/2 of the up half. With ROPE, each head's rows d and
        d + HALF alternate, the pairs rope rotates together. Rows past N are masked where loaded; in a partial
        last GLU block, gate rows past N/2 read real rows of the up half, whose products are never stored."""
        j = tl.arange(0, BLOCK_N)
        if GLU:
            i = pid * (BLOCK_N // 2) + j // 2
            return i + (j % 2) * (N // 2)
        if ROPE:
            i = pid * (BLOCK_N // 2) + j // 2
            return (i // HALF) * (2 * HALF) + i % HALF + (j % 2) * HALF
        return pid * BLOCK_N + j

    @triton.jit
    def _gemv_kernel(X, W, SCALE, BIAS, NW, OUT, N, K, stride_wn, eps, SQ, SQ_N,
                     R_COS, R_SIN, R_KV, R_PAGE, R_SLOT, r_sp, r_skv, r_ss, r_sh, r_limit, r_kinv, r_vinv, TOK, TOK_NW, SQ_CNT,
                     HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
                     ADD_TO_OUT: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ROPE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                     KV_FP8: tl.constexpr, NORM_W: tl.constexpr, SQ_IN: tl.constexpr, SQ_OUT: tl.constexpr,
                     TOKEN_OUT: tl.constexpr, SQ_ONE: tl.constexpr, SQ_BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        rn = _rows(pid, N, BLOCK_N, GLU, ROPE, HALF)
        rk = tl.arange(0, BLOCK_K)
        rows = W + rn[:, None].to(tl.int64) * stride_wn
        nmask = rn[:, None] < N
        # The first weight tile is loaded before the wait: no kernel of the step writes weights.
        w = tl.load(rows + rk[None, :], mask=nmask & (rk[None, :] < K), other=0.0)
        nw_out = _next_norm_weight(TOK_NW, rn, N, TOKEN_OUT)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        r_in = _stream_rows(OUT, rn, N, ADD_TO_OUT)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk  # (X + k0 + rk would add k0 to the pointer first: two more registers, and less occupancy)
            x = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
            if NORM:
                # rmsnorm's scale is one number for the whole token: gather its sum of squares on the way and
                # apply it to the finished rows, so the token is read once, in the slices the loop reads anyway.
                sq += x * x
            if NORM_W:
                x = x * tl.load(NW + kk, mask=kk < K, other=0.0).to(tl.float32)
            nk = k0 + BLOCK_K + rk
            w_next = tl.load(rows + nk[None, :], mask=nmask & (nk[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            w = w_next
        sqs = tl.sum(sq, axis=0)
        if SQ_IN > 0:
            si = tl.arange(0, SQ_IN)
            sqs = tl.sum(tl.load(SQ + si, mask=si < SQ_N, other=0.0), axis=0)
        _finish(tl.sum(acc, axis=1), sqs, r_in, nw_out, pid, rn, SCALE, BIAS, OUT, N, K, eps, SQ, SQ_N, HAS_SCALE,
                HAS_BIAS, NORM, GLU, ADD_TO_OUT, BLOCK_N, R_COS, R_SIN, R_KV, R_PAGE, R_SLOT, r_sp, r_skv, r_ss, r_sh, r_limit, r_kinv, r_vinv, ROPE, HQ, HKV, HALF, KV_FP8, SQ_IN, SQ_OUT, TOK, TOK_NW, TOKEN_OUT, SQ_CNT, SQ_ONE,
                SQ_BLOCK)

    @triton.jit
    def _next_norm_weight(TOK_NW, rn, N, TOKEN_OUT: tl.constexpr):
        """The next norm's weight at this program's rows, for the token a residual add leaves: constant, like
        the weights, so requested before the PDL wait, and in hand when the rows are finished."""
        if TOKEN_OUT:
            return tl.load(TOK_NW + rn, mask=rn < N, other=0.0).to(tl.float32)
        return tl.zeros([rn.shape[0]], dtype=tl.float32)

    @triton.jit
    def _stream_rows(OUT, rn, N, ADD_TO_OUT: tl.constexpr):
        """The residual stream at this program's rows, requested right after the PDL wait: the K loop hides
        the load's latency, which the program's last steps would otherwise wait out."""
        if ADD_TO_OUT:
            return tl.load(OUT + rn, mask=rn < N, other=0.0).to(tl.float32)
        return tl.zeros([rn.shape[0]], dtype=tl.float32)

    @triton.jit
    def _finish(y, sq, r_in, nw_out, pid, rn, SCALE, BIAS, OUT, N, K, eps, SQ, SQ_N, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                NORM: tl.constexpr, GLU: tl.constexpr, ADD_TO_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                R_COS, R_SIN, R_KV, R_PAGE, R_SLOT, r_sp, r_skv, r_ss, r_sh, r_limit, r_kinv, r_vinv, ROPE: tl.constexpr,
                HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, KV_FP8: tl.constexpr,
                SQ_IN: tl.constexpr, SQ_OUT: tl.constexpr, TOK, TOK_NW, TOKEN_OUT: tl.constexpr, SQ_CNT,
                SQ_ONE: tl.constexpr, SQ_BLOCK: tl.constexpr):
        """The finished rows y (weight rows rn): the folded norm's scale (sq: the token's
        sum of squares; r_in: the stream's rows, nw_out: the next norm's weight, where they are used), the weights' scale, the bias, then the activation, rope and the KV store, or the
        residual add; stored."""
        if NORM or SQ_IN > 0:
            y = y * tl.rsqrt(sq / K + eps)
        if HAS_SCALE:
            y = y * tl.load(SCALE + rn, mask=rn < N, other=0.0)
        if HAS_BIAS:
            y += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = y.to(OUT.dtype.element_ty)
        if GLU:
            # Rounded as silu_and_mul rounds the bf16 projection it reads: silu(gate) to the dtype, then times up.
            gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
            g = gate.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(up.dtype)
            ro = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(OUT + ro, (s.to(tl.float32) * up.to(tl.float32)).to(OUT.dtype.element_ty), mask=ro < N // 2)
        elif ROPE:
            _rope_store(y, pid, OUT, R_COS, R_SIN, R_KV, R_PAGE, R_SLOT, r_sp, r_skv, r_ss, r_sh, r_limit, r_kinv, r_vinv, BLOCK_N,
                        HQ, HKV, HALF, KV_FP8)
        else:
            if ADD_TO_OUT:
                # The residual add, rounded to the stream's dtype as the separate add is. Each program reads
                # and writes only its own rows, so updating in place is safe.
                y = (y.to(tl.float32) + r_in).to(OUT.dtype.element_ty)
                if SQ_OUT:
                    # This program's share of the updated stream's sum of squares, for the norm the next
                    # projection folds (SQ_IN), so that it need not gather it from the token itself.
                    f = tl.where(rn < N, y.to(tl.float32), 0.0)
                    tl.store(SQ + pid, tl.sum(f * f, axis=0))
                    if SQ_ONE:
                        # The last program to arrive adds every program's share into SQ[0], in index order (the
                        # same sum whichever program is last), so the next GEMV's programs load one number.
                        tl.debug_barrier()
                        arrived = tl.atomic_add(SQ_CNT, 1, sem="acq_rel", scope="gpu")
                        if arrived == tl.num_programs(0) - 1:
                            si = tl.arange(0, SQ_BLOCK)
                            parts = tl.load(SQ + si, mask=si < tl.num_programs(0), other=0.0, cache_modifier=".cg")
                            tl.store(SQ, tl.sum(parts, axis=0))
                            tl.store(SQ_CNT, 0)  # ready for the next launch (a graph replays the same counter)
                if TOKEN_OUT:
                    # The next norm's weight applied here, once per element, rather than in every program
                    # of the GEMV that folds it.
                    tl.store(TOK + rn, (y.to(tl.float32) * nw_out).to(TOK.dtype.element_ty), mask=rn < N)
            tl.store(OUT + rn, y, mask=rn < N)

    @triton.jit
    def _rope_store(y, pid, Q, COS, SIN, KV, PAGE, SLOT, s_kv_p, s_kv_kv, s_kv_s, s_kv_h, limit, k_inv, v_inv,
                    BLOCK_N: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                    FP8: tl.constexpr):
        """kernels/rope.py's rope_store on the finished qkv rows y (pairs d, d + HALF of a head, rounded to
        the activation dtype): q heads rotated into Q [HQ, 2 * HALF], k heads rotated and v heads as they are
        into the token's pool slot, divided by their scales, rounded (and saturated for an FP8 pool) as
        rope_store rounds them."""
        x1, x2 = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        i = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        head = i // HALF
        d = i % HALF
        c = tl.load(COS + HALF + d).to(tl.float32)
        s = tl.load(SIN + HALF + d).to(tl.float32)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        r1 = a * c - b * s
        r2 = b * c + a * s
        is_q = head < HQ
        qo = Q + head * (2 * HALF) + d
        tl.store(qo, r1.to(Q.dtype.element_ty), mask=is_q)
        tl.store(qo + HALF, r2.to(Q.dtype.element_ty), mask=is_q)
        is_k = (head >= HQ) & (head < HQ + HKV)
        is_kv = (head >= HQ) & (head < HQ + 2 * HKV)
        # k is rounded to the activation dtype first, as rope_store rounds it.
        k1 = tl.where(is_k, r1.to(Q.dtype.element_ty).to(tl.float32) * k_inv, a * v_inv)
        k2 = tl.where(is_k, r2.to(Q.dtype.element_ty).to(tl.float32) * k_inv, b * v_inv)
        if FP8:
            k1 = tl.clamp(k1, -limit, limit)
            k2 = tl.clamp(k2, -limit, limit)
        page = tl.load(PAGE).to(tl.int64)
        slot = tl.load(SLOT).to(tl.int64)
        kv_head = tl.where(is_k, head - HQ, head - HQ - HKV).to(tl.int64)
        dst = KV + page * s_kv_p + slot * s_kv_s + kv_head * s_kv_h + d + tl.where(is_k, 0, s_kv_kv)
        tl.store(dst, k1.to(KV.dtype.element_ty), mask=is_kv)
        tl.store(dst + HALF, k2.to(KV.dtype.element_ty), mask=is_kv)

    @triton.jit
    def _e4m3x4(w, PTX: tl.constexpr):
        """The four e4m3 numbers packed in each int32 of w, lowest byte first, as float32. On a GPU: two PTX
        unpacks to half pairs and four widenings per word; the interpreter takes the bytes apart instead."""
        if PTX:
            return tl.inline_asm_elementwise(
                """{
                .reg .b16 l, h, a0, a1, a2, a3;
                .reg .b32 p, q;
                mov.b32 {l, h}, $4;
                cvt.rn.f16x2.e4m3x2 p, l;
                cvt.rn.f16x2.e4m3x2 q, h;
                mov.b32 {a0, a1}, p;
                mov.b32 {a2, a3}, q;
                cvt.f32.f16 $0, a0;
                cvt.f32.f16 $1, a1;
                cvt.f32.f16 $2, a2;
                cvt.f32.f16 $3, a3;
                }""",
                "=r,=r,=r,=r,r", [w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        f0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return f0, f1, f2, f3

    @triton.jit
    def _load_x(X, NW, kk, K, NORM_W: tl.constexpr):
        """The token at kk (zero past K) and, when the norm is folded, the same times the norm's weight."""
        x = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
        if NORM_W:
            return x, x * tl.load(NW + kk, mask=kk < K, other=0.0).to(tl.float32)
        return x, x

    @triton.jit
    def _e4m3_tile(acc, sq, w, X, NW, kk, K, NORM: tl.constexpr, NORM_W: tl.constexpr, PTX: tl.constexpr):
        """acc += the word tile w times the token at kk, kk+1, kk+2, kk+3 (kk: four times the tile's word
        columns); sq += the token's squares where the norm is folded. Past K the token reads as zero."""
        r0, x0 = _load_x(X, NW, kk, K, NORM_W)
        r1, x1 = _load_x(X, NW, kk + 1, K, NORM_W)
        r2, x2 = _load_x(X, NW, kk + 2, K, NORM_W)
        r3, x3 = _load_x(X, NW, kk + 3, K, NORM_W)
        if NORM:
            sq += r0 * r0 + r1 * r1 + r2 * r2 + r3 * r3
        f0, f1, f2, f3 = _e4m3x4(w, PTX)
        # One multiply-add each, in sequence (a sum of products first costs a multiply and an add more).
        acc += f0 * x0[None, :]
        acc += f1 * x1[None, :]
        acc += f2 * x2[None, :]
        acc += f3 * x3[None, :]
        return acc, sq

    @triton.jit
    def _gemv_e4m3_kernel(X, W, SCALE, BIAS, NW, OUT, N, K, stride_wn, eps, SQ, SQ_N,
                          R_COS, R_SIN, R_KV, R_PAGE, R_SLOT, r_sp, r_skv, r_ss, r_sh, r_limit, r_kinv, r_vinv, TOK, TOK_NW,
                          SQ_CNT, WORK, COUNTERS, PTX: tl.constexpr,
                          HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                          GLU: tl.constexpr, ADD_TO_OUT: tl.constexpr, PDL: tl.constexpr, EVEN: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          ROPE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                          KV_FP8: tl.constexpr, AHEAD: tl.constexpr, NORM_W: tl.constexpr,
                          SQ_IN: tl.constexpr, SQ_OUT: tl.constexpr, TOKEN_OUT: tl.constexpr,
                          SQ_ONE: tl.constexpr, SQ_BLOCK: tl.constexpr):
        """_gemv_kernel for e4m3 weights read as int32 words, four weights each (K % 4 == 0, stride_wn in
        words). The four values of a word meet four slices of the token taken with a stride of four. Loaded as
        bytes, each weight was extracted, repacked in pairs and then converted: about four instructions per
        weight besides its multiply-add, which bound the kernel by instruction issue below the copy ceiling.
        SPLIT > 1: program (i, s) takes the s-th of SPLIT slices of K (see the module's docstring); WORK holds
        SPLIT partial rows of every program's BLOCK_N and then SPLIT partial sums of squares, COUNTERS one count per row block.
        AHEAD: weight tiles requested before the one in hand is multiplied (1 or 2). A projection of few rows
        per SM (o_proj, down_proj) has too few programs to keep the memory busy with one tile each."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rn = _rows(pid, N, BLOCK_N, GLU, ROPE, HALF)
        WORDS: tl.constexpr = BLOCK_K // 4
        rj = tl.arange(0, WORDS)
        kw = K // 4
        # This program's words of each row: [lo, hi), whole tiles but the last slice's end.
        span = tl.cdiv(tl.cdiv(kw, SPLIT), WORDS) * WORDS
        lo = split * span
        hi = tl.minimum(lo + span, kw)
        rows = W + rn[:, None].to(tl.int64) * stride_wn
        # Whole tiles load without masks: predicated loads cost a zeroing and a compare per register.
        if EVEN:
            w = tl.load(rows + lo + rj[None, :])
        else:
            w = tl.load(rows + lo + rj[None, :], mask=(rn[:, None] < N) & (lo + rj[None, :] < hi), other=0)
        if AHEAD == 2:  # the second tile too is loaded before the wait
            nj = lo + WORDS + rj
            w1 = tl.load(rows + nj[None, :], mask=(rn[:, None] < N) & (nj[None, :] < hi), other=0)
        nw_out = _next_norm_weight(TOK_NW, rn, N, TOKEN_OUT and SPLIT == 1)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        r_in = _stream_rows(OUT, rn, N, ADD_TO_OUT and SPLIT == 1)
        acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        sq = tl.zeros([WORDS], dtype=tl.float32)
        if AHEAD == 2:
            # Loads past the slice are masked off: they move no data.
            for j0 in range(lo, hi, WORDS):
                nj = j0 + 2 * WORDS + rj
                w2 = tl.load(rows + nj[None, :], mask=(rn[:, None] < N) & (nj[None, :] < hi), other=0)
                acc, sq = _e4m3_tile(acc, sq, w, X, NW, 4 * (j0 + rj), K, NORM, NORM_W, PTX)
                w = w1
                w1 = w2
        else:
            # Each iteration loads the next tile before it multiplies the one in hand; the last tile is
            # multiplied after the loop, so no load goes past the slice (programs of one or two tiles would
            # waste a tile).
            last = lo + tl.maximum(hi - lo - 1, 0) // WORDS * WORDS
            for j0 in range(lo, last, WORDS):
                nj = j0 + WORDS + rj
                if EVEN:
                    w_next = tl.load(rows + nj[None, :])
                else:
                    w_next = tl.load(rows + nj[None, :], mask=(rn[:, None] < N) & (nj[None, :] < hi), other=0)
                acc, sq = _e4m3_tile(acc, sq, w, X, NW, 4 * (j0 + rj), K, NORM, NORM_W, PTX)
                w = w_next
            if lo < hi:
                acc, sq = _e4m3_tile(acc, sq, w, X, NW, 4 * (last + rj), K, NORM, NORM_W, PTX)
        y = tl.sum(acc, axis=1)
        sqs = tl.sum(sq, axis=0)
        if SQ_IN > 0:
            si = tl.arange(0, SQ_IN)
            sqs = tl.sum(tl.load(SQ + si, mask=si < SQ_N, other=0.0), axis=0)
        if SPLIT > 1:
            # Partials by position in the program (GLU rows are not a block of N), PN of them per split.
            PN = tl.num_programs(0) * BLOCK_N
            at = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(WORK + split * PN + at, y)
            if NORM:
                tl.store(WORK + SPLIT * PN + split, sqs)
            # Every thread's partials are written before one thread counts this program in (release); the
            # last to arrive reads them from L2 (.cg: never a line its own SM cached before the count).
            tl.debug_barrier()
            arrived = tl.atomic_add(COUNTERS + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                y = tl.zeros([BLOCK_N], dtype=tl.float32)
                if NORM:  # (else sqs is 0, or the sum of the squares read before the loop)
                    sqs = 0.0
                for s in tl.static_range(SPLIT):
                    y += tl.load(WORK + s * PN + at, cache_modifier=".cg")
                    if NORM:
                        sqs += tl.load(WORK + SPLIT * PN + s, cache_modifier=".cg")
                tl.store(COUNTERS + pid, 0)  # ready for the next launch (a graph replays the same counters)
                # Only the program that finishes the rows needs the stream's and the next norm's weight.
                r_in = _stream_rows(OUT, rn, N, ADD_TO_OUT)
                nw_out = _next_norm_weight(TOK_NW, rn, N, TOKEN_OUT)
                _finish(y, sqs, r_in, nw_out, pid, rn, SCALE, BIAS, OUT, N, K, eps, SQ, SQ_N, HAS_SCALE, HAS_BIAS, NORM, GLU,
                        ADD_TO_OUT, BLOCK_N, R_COS, R_SIN, R_KV, R_PAGE, R_SLOT, r_sp, r_skv, r_ss, r_sh, r_limit, r_kinv, r_vinv, ROPE, HQ, HKV, HALF, KV_FP8, SQ_IN, SQ_OUT, TOK, TOK_NW, TOKEN_OUT, SQ_CNT, SQ_ONE,
                SQ_BLOCK)
        else:
            _finish(y, sqs, r_in, nw_out, pid, rn, SCALE, BIAS, OUT, N, K, eps, SQ, SQ_N, HAS_SCALE, HAS_BIAS, NORM, GLU, ADD_TO_OUT,
                    BLOCK_N, R_COS, R_SIN, R_KV, R_PAGE, R_SLOT, r_sp, r_skv, r_ss, r_sh, r_limit, r_kinv, r_vinv, ROPE, HQ, HKV, HALF, KV_FP8, SQ_IN, SQ_OUT, TOK, TOK_NW, TOKEN_OUT, SQ_CNT, SQ_ONE,
                SQ_BLOCK)
