"""Paged attention in Triton: a split-KV decode kernel and a prefill kernel over a cached prefix.

Both read K/V straight from the pool through the page table, so nothing is gathered or padded in memory.
The layer's K scale (kvstore/pool.py) is folded into the softmax scale, and its V scale into the output.

Decode, for request b and KV head h (GQA: the G query heads sharing h are one tile, so K/V is read once per
group), split s of the KV range:   scores = q[G, D] . K[t, D] for t in the split, online softmax, partial
output and log-sum-exp; a second kernel merges the splits. Splits give long contexts enough parallelism.

Prefill, for request b, query head h, a block of BLOCK_M new tokens at positions prefix+i: flash attention
over KV positions 0 .. min(prefix+i, seq_len-1), sliding window honoured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention.base import AttentionBackend, AttentionInputs, AttentionStep
from kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One KV tile into the online softmax of the query heads q: (m_i, l_i, acc) updated."""
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [G, N]
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    Q, KV, indptr, indices, seq_lens, O_part, LSE_part,
    stride_qb, stride_qh,
    stride_kp, stride_kkv, stride_ks, stride_kh,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    scale, v_scale, window,
    S: tl.constexpr, PAGE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr, EARLY_KV: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    s = tl.program_id(2)
    # The step's page table is written before the step starts; q and the new token's K/V by the previous kernel.
    seq_len = tl.load(seq_lens + b)
    page_base = tl.load(indptr + b)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    # Each request's own KV range is cut into at most S splits of at least MIN_CHUNK tokens: S is fixed at
    # plan time for the longest context a CUDA graph may replay, and a shorter context leaves the last
    # splits empty rather than cutting its KV into slivers. An empty split ends here, storing nothing (the
    # merge reads only the splits its request has): a graph planned for 128k tokens replayed at 2k has
    # seven empty programs for each busy one. A split is a whole number of tiles, so that its tiles start on
    # page boundaries: 683-token splits of 64-token tiles read a third of their pages in two pieces.
    chunk = tl.cdiv(tl.maximum(tl.cdiv(seq_len - lo, S), MIN_CHUNK), BLOCK_N) * BLOCK_N
    start = lo + s * chunk
    end = tl.minimum(start + chunk, seq_len)
    if end > start:
        # The page table is written before the step: the first tile's entries are read before the wait, and
        # each later tile's one tile ahead. EARLY_KV: so is the first tile's K/V, all but the step's own token
        # (the request's last), which the previous kernel writes; the K/V stream then starts while the previous
        # kernel drains (few requests, one or two tiles a split). Long splits keep one pipelined loop.
        d = tl.arange(0, BLOCK_D)
        dmask = d[None, :] < D
        t = start + tl.arange(0, BLOCK_N)
        page = tl.load(indices + page_base + t // PAGE, mask=t < end, other=0).to(tl.int64)
        if EARLY_KV:
            valid = t < end
            row = page * stride_kp + (t % PAGE) * stride_ks + kvh * stride_kh
            old = (valid & (t < seq_len - 1))[:, None] & dmask
            # Widened to the query's dtype at once: k and v are carried into the loop below, which loads them
            # widened (an FP8 pool), and a loop-carried value keeps one type.
            k = tl.load(KV + row[:, None] + d[None, :], mask=old, other=0.0).to(Q.dtype.element_ty)
            v = tl.load(KV + stride_kkv + row[:, None] + d[None, :], mask=old, other=0.0).to(Q.dtype.element_ty)
            tn = t + BLOCK_N
            page = tl.load(indices + page_base + tn // PAGE, mask=tn < end, other=0).to(tl.int64)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        g = tl.arange(0, BLOCK_G)
        heads = kvh * G + g
        # The group's query heads form the M side of a tensor-core dot (padded to 16 rows).
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=(g[:, None] < G) & dmask, other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        first = start
        if EARLY_KV:
            if start + BLOCK_N >= seq_len:  # the step's token is in this tile
                new = (t == seq_len - 1)[:, None] & dmask
                k = tl.where(new, tl.load(KV + row[:, None] + d[None, :], mask=new, other=0.0).to(q.dtype), k)
                v = tl.where(new, tl.load(KV + stride_kkv + row[:, None] + d[None, :], mask=new, other=0.0).to(q.dtype),
                             v)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, scale, PRECISION)
            first = start + BLOCK_N
        for t0 in range(first, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            valid = t < end
            row = page * stride_kp + (t % PAGE) * stride_ks + kvh * stride_kh
            # One page-table read per token: tiles of whole pages with one read per page (a reshape of
            # [pages, PAGE] rows) measured 2-2.4x slower on an H200 (benchmarks.md, run O).
            tn = t + BLOCK_N
            page = tl.load(indices + page_base + tn // PAGE, mask=tn < end, other=0).to(tl.int64)
            kmask = valid[:, None] & dmask
            k = tl.load(KV + row[:, None] + d[None, :], mask=kmask, other=0.0).to(q.dtype)
            v = tl.load(KV + stride_kkv + row[:, None] + d[None, :], mask=kmask, other=0.0).to(q.dtype)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, scale, PRECISION)
        out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        lse = m_i + tl.log(tl.where(l_i > 0, l_i, 1.0))
        omask = (g[:, None] < G) & (d[None, :] < D)
        tl.store(O_part + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + d[None, :], out,
                 mask=omask)
        tl.store(LSE_part + b * stride_lb + heads * stride_lh + s, lse, mask=g < G)


@triton.jit
def _decode_merge_kernel(O_part, LSE_part, Out, seq_lens, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         stride_b, stride_h, window, S: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, MIN_CHUNK: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    # The splits this request has, cut as the split kernel cuts them.
    n = tl.load(seq_lens + b)
    if window > 0:
        n = n - tl.maximum(n - window, 0)
    used = tl.cdiv(n, tl.cdiv(tl.maximum(tl.cdiv(n, S), MIN_CHUNK), TILE) * TILE)
    if PDL:
        # Signalled before the wait (kernels/pdl.py): o_proj's programs then launch while the split kernel
        # runs and load their first weight tiles while the memory is otherwise idle. 1.0-1.4 % off the 8B
        # batch-1 steps, bf16 and FP8, on an H200 (docs/benchmarks.md, runs Z21-Z22).
        gdc_launch_dependents()
        gdc_wait()
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(LSE_part + b * stride_lb + h * stride_lh + s, mask=s < used, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)
    w = w / tl.sum(w, axis=0)
    o = tl.load(O_part + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                mask=(s[:, None] < used) & (d[None, :] < D), other=0.0)
    out = tl.sum(o * w[:, None], axis=0)
    tl.store(Out + b * stride_b + h * stride_h + d, out.to(Out.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_kernel(
    Q, KV, Out, qo_indptr, indptr, indices, seq_lens, prefix_lens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kkv, stride_ks, stride_kh,
    scale, v_scale, window,
    PAGE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    n_q = tl.load(qo_indptr + b + 1) - q_start
    if mblk * BLOCK_M >= n_q:
        return
    prefix = tl.load(prefix_lens + b)
    seq_len = tl.load(seq_lens + b)
    kvh = h // G
    i = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qmask = (i[:, None] < n_q) & (d[None, :] < D)
    q = tl.load(Q + (q_start + i)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=qmask, other=0.0)
    q_pos = prefix + i
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    page_base = tl.load(indptr + b)
    hi = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)
    lo = 0
    if window > 0:
        lo = tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < seq_len
        page = tl.load(indices + page_base + t // PAGE, mask=valid, other=0).to(tl.int64)
        row = page * stride_kp + (t % PAGE) * stride_ks + kvh * stride_kh
        kmask = valid[:, None] & (d[None, :] < D)
        # An FP8 pool is widened to the query's dtype as it is read; its scales apply to scores and output.
        k = tl.load(KV + row[:, None] + d[None, :], mask=kmask, other=0.0).to(q.dtype)
        v = tl.load(KV + stride_kkv + row[:, None] + d[None, :], mask=kmask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        allowed = valid[None, :] & (t[None, :] <= q_pos[:, None])
        if window > 0:
            allowed = allowed & ((q_pos[:, None] - t[None, :]) < window)
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(Out + (q_start + i)[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=qmask)


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of the decode kernel: KV tokens per inner step, warps, software-pipeline stages; the
    longest split the plan aims for, and the shortest split the kernel cuts (see _decode_split_kernel)."""
    block_n: int
    warps: int
    stages: int
    max_chunk: int
    min_chunk: int
    early_kv: bool = False  # the first KV tile read before the PDL wait (_decode_split_kernel)
    # The grid's first axis is the KV head, not the request: in NHD pages a request's heads lie side by side,
    # and programs launched together then read whole rows of them.
    heads_first: bool = False


class TritonBackend(AttentionBackend):
    # Two regimes. Few requests (fewer (request, KV head) pairs than target_programs) need many short splits
    # to fill the SMs: 32-token tiles, 3 stages (the batch-1 rows of benchmarks.md, run N). Many requests
    # stream splits of 512 tokens (longer only where the batch would exceed max_programs) in 32-token tiles,
    # two stages, one request's KV heads launched side by side: the batch-64, 2k-context 8B step (CUDA graph)
    # went from 10.24 ms (64-token tiles, 4 stages, splits of up to 1024) to 9.42 ms on an H200, and one
    # layer's attention from 172 to 157 us when planned for its own context, 170 to 141 us as a graph plans
    # it (runs Z25-Z27; `python -m bench.gpu --tune-decode` sweeps these settings).
    # A split is at least one tile for few requests (one tile a program at short contexts).
    decode_small = DecodeLaunch(block_n=32, warps=4, stages=3, max_chunk=256, min_chunk=32, early_kv=True)
    decode_large = DecodeLaunch(block_n=32, warps=4, stages=2, max_chunk=512, min_chunk=512, heads_first=True)
    target_programs = 256  # programs to aim for: a few per SM
    max_splits = 64
    # Splits are capped so that batch x KV heads x splits stays under this: the partial outputs of a graph
    # planned for a long context stay small however large the batch.
    max_programs = 16384

    def plan(self, inputs: AttentionInputs) -> AttentionStep:
        return _TritonStep(self, inputs)


class _TritonStep(AttentionStep):
    def __init__(self, backend: TritonBackend, x: AttentionInputs):
        self.pool = backend.pool
        self.backend = backend
        self.x = x
        c = backend.config
        self.scale = c.head_dim ** -0.5
        self.window = c.sliding_window or 0
        self.group = c.num_attention_heads // c.num_key_value_heads
        # Splits: enough programs (batch x kv heads x splits) to fill the GPU several times over, and splits of
        # at most max_chunk tokens for long contexts; never more than min_chunk-token splits can use.
        programs = x.batch_size * c.num_key_value_heads
        self.launch = launch = backend.decode_small if programs < backend.target_programs else backend.decode_large
        want = max(triton.cdiv(backend.target_programs, programs), triton.cdiv(x.max_seq_len, launch.max_chunk))
        self.splits = max(1, min(want, backend.max_splits, backend.max_programs // programs,
                                 triton.cdiv(x.max_seq_len, launch.min_chunk)))

    def attend(self, q, layer_id):
        x = self.x
        kv = self.pool.tokens_view(layer_id)  # [P, 2, page, Hkv, D], strided for HND
        heads, dim = q.shape[1], q.shape[2]
        block_d = triton.next_power_of_2(dim)
        # float32 pools keep float32 products (no tf32); bf16/fp16 use the tensor cores as they are.
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        scale, v_scale = self.scale * self.pool.k_scale[layer_id], self.pool.v_scale[layer_id]
        out = torch.empty_like(q)
        if x.is_decode:
            on = pdl.enabled(q)
            bsz = x.batch_size
            o_part = torch.empty(bsz, heads, self.splits, dim, dtype=torch.float32, device=q.device)
            lse = torch.empty(bsz, heads, self.splits, dtype=torch.float32, device=q.device)
            grid = (bsz, heads // self.group, self.splits)
            if self.launch.heads_first:
                grid = (grid[1], grid[0], grid[2])
            _decode_split_kernel[grid](
                q, kv, x.kv_indptr, x.kv_indices, x.seq_lens, o_part, lse,
                q.stride(0), q.stride(1),
                kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
                o_part.stride(0), o_part.stride(1), o_part.stride(2),
                lse.stride(0), lse.stride(1),
                scale, v_scale, self.window,
                S=self.splits, PAGE=self.pool.page_size, G=self.group, BLOCK_G=max(16, triton.next_power_of_2(self.group)),
                D=dim, BLOCK_D=block_d, BLOCK_N=self.launch.block_n, MIN_CHUNK=self.launch.min_chunk,
                PRECISION=precision,
                PDL=on, EARLY_KV=self.launch.early_kv, HEADS_FIRST=self.launch.heads_first,
                launch_pdl=on, num_warps=self.launch.warps, num_stages=self.launch.stages,
            )
            _decode_merge_kernel[(bsz, heads)](
                o_part, lse, out, x.seq_lens, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), self.window, S=self.splits,
                BLOCK_S=max(2, triton.next_power_of_2(self.splits)), D=dim, BLOCK_D=block_d,
                MIN_CHUNK=self.launch.min_chunk, TILE=self.launch.block_n, PDL=on, launch_pdl=on,
            )
            return out
        block_m = 128
        _prefill_kernel[(x.batch_size, heads, triton.cdiv(x.max_extend_len, block_m))](
            q, kv, out, x.qo_indptr, x.kv_indptr, x.kv_indices, x.seq_lens, x.prefix_lens,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            scale, v_scale, self.window,
            PAGE=self.pool.page_size, G=self.group, D=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=64,
            PRECISION=precision, num_warps=8,
        )
        return out
