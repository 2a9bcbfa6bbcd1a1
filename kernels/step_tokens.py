"""The tokens a decode graph starts and ends with, each in one launch on the device.

At its start, `fill_tokens` puts the previous step's tokens (still on the device: steps overlap, so the host
has not read them yet) into the rows of the step's input ids that wait for them. Outside the graph that was
an index_select and an index_copy_ after the step's input copies.

At its end, `argmax_tokens` picks each row's greedy token: the first index of the row's maximum, as
torch.argmax picks it; `sample_tokens` draws each row's token at its temperature in the same pass (rows at
temperature 0 stay greedy), by the Gumbel-max rule engine/sampler.py defines: the argmax of
logits / T - log(-log u), u the counter-based noise of (seed, draw index, token id). The draw is exactly one
from softmax(logits / T), and the same expression, operation for operation (IEEE division, libdevice's log),
as the sampler's torch code, so a seeded request draws the same token inside a graph or outside. A decode graph used to end in the logits; greedy sampling outside it took five small kernels at the edge of every
step (two reduction rounds, then the index arithmetic), about 23 us of a 0.6 ms 0.5B step on an H200 (docs/benchmarks.md, runs Z35-Z36). This
kernel is captured in the graph after the LM head, launched with PDL: program (row, c) reduces chunk c of
its row (CHUNK tokens) to (largest value, its first index) and the last program of the row to arrive (a counter per row,
which it resets) picks the first chunk holding the row's maximum. Chunks are taken in order, so ties resolve
to the smallest index, whichever program arrives last. NaN counts as larger than any number, as in torch;
a row holding both +inf and a NaN is the one case that may differ (torch takes the NaN).
"""

from __future__ import annotations

import torch

from kernels import pdl

try:
    import triton
    import triton.language as tl

    from triton.language.extra import libdevice

    from kernels.pdl import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU installs without triton
    triton = None

CHUNK = 2048  # tokens a program reads, in one load: a 150k vocabulary is 75 programs a row


def counters_for(rows: int, device: torch.device) -> torch.Tensor:
    """The counters a launch of up to `rows` rows needs: zeros, and left at zero by every launch."""
    return torch.zeros(rows, dtype=torch.int32, device=device)


def fill_tokens(ids: torch.Tensor, source: torch.Tensor, tokens: torch.Tensor) -> None:
    """ids[i] = tokens[source[i]] where source[i] >= 0, in place (int64 [B] each; tokens any length)."""
    if ids.shape != source.shape or ids.dim() != 1 or ids.dtype != torch.int64 or source.dtype != torch.int64 \
            or tokens.dtype != torch.int64 or not ids.is_contiguous():
        raise ValueError(f"fill_tokens: ids {tuple(ids.shape)} {ids.dtype}, source {tuple(source.shape)} "
                         f"{source.dtype}, tokens {tokens.dtype}")
    on = pdl.enabled(ids) if ids.is_cuda else False
    opts = dict(launch_pdl=on, num_warps=1) if ids.is_cuda else {}
    _fill_kernel[(1,)](ids, source, tokens, ids.numel(), BLOCK=max(16, triton.next_power_of_2(ids.numel())), PDL=on,
                       **opts)


def argmax_tokens(logits: torch.Tensor, counters: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (float32/bf16/fp16, rows contiguous) -> int64 [B] (into `out` if given), equal to
    logits.argmax(dim=-1)."""
    return sample_tokens(logits, counters, out=out)


def sample_tokens(logits: torch.Tensor, counters: torch.Tensor, temperature: torch.Tensor | None = None,
                  seeds: torch.Tensor | None = None, draws: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token, int64 [B] (into `out` if given): with `temperature` (float32 [B]), `seeds` and
    `draws` (int64 [B]: the request's seed, the index of the token drawn), the argmax of
    logits / T - log(-log u(seed, draw, token)) for rows with T > 0 (engine.sampler.draw) and of the logits
    for rows with T == 0; without them, logits.argmax(dim=-1). With `floor` (float32 [B], in units of
    logits / T: kernels/truncation.thresholds), a row at T > 0 draws only among the tokens whose logits / T
    are >= its floor, as engine.sampler.truncated_draw draws after truncation."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"sample_tokens: logits {tuple(logits.shape)} with strides {logits.stride()}")
    rows, vocab = logits.shape
    sample = temperature is not None
    if sample and any(t is None or t.shape != (rows,) or t.device != logits.device or not t.is_contiguous()
                      for t in (temperature, seeds, draws)):
        raise ValueError(f"sample_tokens: temperature, seeds and draws must each be [{rows}] on {logits.device}")
    if sample and (temperature.dtype != torch.float32 or seeds.dtype != torch.int64 or draws.dtype != torch.int64):
        raise ValueError(f"sample_tokens: temperature float32, seeds and draws int64, got {temperature.dtype}, "
                         f"{seeds.dtype}, {draws.dtype}")
    if floor is not None and (not sample or floor.shape != (rows,) or floor.dtype != torch.float32
                              or floor.device != logits.device or not floor.is_contiguous()):
        raise ValueError(f"sample_tokens: a floor must be float32 [{rows}] on {logits.device}, with temperatures")
    if counters.dtype != torch.int32 or counters.numel() < rows or counters.device != logits.device:
        raise ValueError(f"sample_tokens: {rows} int32 counters on {logits.device} needed")
    chunks = triton.cdiv(vocab, CHUNK)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"sample_tokens: out {tuple(out.shape)} {out.dtype} for {rows} rows")
    on = pdl.enabled(logits) if logits.is_cuda else False
    opts = dict(launch_pdl=on, num_warps=4) if logits.is_cuda else {}
    params = (temperature, seeds, draws) if sample else (values, values, values)
    _argmax_kernel[(rows, chunks)](logits, logits.stride(0), vocab, values, index, counters, out, *params,
                                   values if floor is None else floor, CHUNK=CHUNK, CHUNKS=chunks,
                                   BLOCK_C=triton.next_power_of_2(chunks), PDL=on, SAMPLE=sample,
                                   FLOOR=floor is not None, EXACT=logits.is_cuda, **opts)
    return out


if triton is not None:
    @triton.jit
    def _fill_kernel(IDS, SOURCE, TOKENS, B, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        i = tl.arange(0, BLOCK)
        src = tl.load(SOURCE + i, mask=i < B, other=-1)
        take = (i < B) & (src >= 0)
        tl.store(IDS + i, tl.load(TOKENS + tl.maximum(src, 0), mask=take, other=0), mask=take)

    @triton.jit
    def _fmix32(h):
        """murmur3's finaliser on int64 values below 2 ** 32, as engine.sampler._fmix32 computes it."""
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _log(x, EXACT: tl.constexpr):
        if EXACT:  # the CUDA math library's logf, which torch.log calls (tl.log may lower to an approximation)
            return libdevice.log(x)
        return tl.log(x)

    @triton.jit
    def _argmax_kernel(X, stride_x, V, VALUES, INDEX, COUNTERS, OUT, TEMP, SEEDS, DRAWS, FLOORS,
                       CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
                       SAMPLE: tl.constexpr, FLOOR: tl.constexpr, EXACT: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        if SAMPLE:  # the row's parameters (step inputs, written before the graph ran: read before the wait)
            temp = tl.load(TEMP + row)
            seed = tl.load(SEEDS + row)
            key = _fmix32((seed & 0xFFFFFFFF) ^ _fmix32(((seed >> 32) & 0xFFFFFFFF)
                                                       ^ _fmix32(tl.load(DRAWS + row) & 0xFFFFFFFF)))
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        # The whole chunk in one load: the logits were just written, so this is one round trip to L2.
        t = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(X + row.to(tl.int64) * stride_x + t, mask=t < V, other=float("-inf")).to(tl.float32)
        if SAMPLE:
            if temp > 0:
                # engine.sampler.uniform_noise and draw, term for term.
                h = _fmix32(key ^ ((t.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF))
                h = _fmix32(h ^ key)
                u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / (1 << 23))  # engine.sampler.unit_interval
                x = tl.math.div_rn(x, temp)
                if FLOOR:  # (the previous kernel's: read after the wait)
                    x = tl.where(x < tl.load(FLOORS + row), float("-inf"), x)
                x = x - _log(-_log(u, EXACT), EXACT)
        # NaN wins, as in torch; lanes past the vocabulary never do, whatever their noise.
        x = tl.where(t < V, tl.where(x != x, float("inf"), x), float("-inf"))
        best = tl.max(x, axis=0)
        # An all -inf chunk reports its first token, so that an all -inf row is token 0, as in torch.
        at = c * CHUNK + tl.argmax(x, axis=0, tie_break_left=True)
        tl.store(VALUES + row * CHUNKS + c, best)
        tl.store(INDEX + row * CHUNKS + c, at)
        # Every chunk's result is written before this program counts itself in (release); the last to arrive
        # reads them from L2 (.cg: never a line its own SM cached before the count).
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNTERS + row, 1, sem="acq_rel", scope="gpu")
        if arrived == CHUNKS - 1:
            j = tl.arange(0, BLOCK_C)
            v = tl.load(VALUES + row * CHUNKS + j, mask=j < CHUNKS, other=float("-inf"), cache_modifier=".cg")
            idx = tl.load(INDEX + row * CHUNKS + j, mask=j < CHUNKS, other=0, cache_modifier=".cg")
            first = tl.argmax(v, axis=0, tie_break_left=True)
            tl.store(OUT + row, tl.sum(tl.where(j == first, idx, 0), axis=0).to(tl.int64))
            tl.store(COUNTERS + row, 0)  # ready for the next launch (a graph replays the same counters)
