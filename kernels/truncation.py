"""Top-k and top-p thresholds without a sort: each row's smallest kept logit, found digit by digit.

Sorting a 150k-token row to truncate it took most of a sampled step's extra time on an H200: top-p 0.95 made a
0.5B batch-1 step 0.75 ms against 0.55 greedy (docs/benchmarks.md, Z69), the sort, softmax, cumsum and scatter
back over the whole row. Truncation only needs one number per row, the threshold below which tokens go, and
that number can be selected rather than sorted for (a radix select).

Logits map to 32-bit keys that order as the floats do. Eight passes each fix four bits of the threshold's
key, from the top: a pass histograms the row's tokens whose key starts with the bits fixed so far by their
next four (count or softmax mass per digit value, every program a chunk of the row, partial histograms
summed in a fixed order, so the result does not depend on scheduling), and a one-program-per-row step picks
the digit holding the threshold:
- top-k (count): the digit where the count of larger tokens first reaches k; the threshold is the k-th
  largest logit;
- top-p (mass): the lowest digit with a token whose larger tokens hold less than top_p of the mass; the
  threshold is the smallest logit kept by "drop a token once the tokens ranked above it reach top_p".
Top-p under top-k counts only the tokens top-k keeps. Tokens equal to the threshold all stay (bf16 logits
tie often), as engine.sampler.sorted_top_k_top_p also keeps them. Nothing here waits for the host, so a graph
captures it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton
    triton = None

CHUNK = 256  # tokens a program reads, in one load: a 150k vocabulary is 594 programs a row
BITS = 4  # a pass fixes 4 bits of the key: eight passes, each comparing a token with 16 digit values


def thresholds(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_top_k: bool = True,
               use_top_p: bool = True) -> torch.Tensor:
    """float32 [B]: each row keeps the logits >= its threshold (-inf where it truncates nothing: top_k <= 0
    and top_p >= 1). logits float32 [B, V], rows contiguous; top_k int64 [B]; top_p float32 [B]."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"thresholds: logits float32 [B, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    rows, vocab = logits.shape
    partial = torch.empty(rows, triton.cdiv(vocab, CHUNK), 1 << BITS, dtype=torch.float32, device=logits.device)
    largest = logits.amax(dim=-1).contiguous()
    no_floor = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    keep = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    floor = no_floor
    if use_top_k:
        key = _select(logits, partial, largest, no_floor, top_k.to(torch.float32).contiguous(), False)
        on = top_k > 0
        floor = torch.where(on, key, no_floor)
        keep = torch.where(on, _key_to_float(key), keep)
    if use_top_p:
        key = _select(logits, partial, largest, floor, top_p.to(torch.float32).contiguous(), True)
        keep = torch.where(top_p < 1.0, torch.maximum(keep, _key_to_float(key)), keep)
    return keep


def _select(logits, partial, largest, floor, target, mass: bool) -> torch.Tensor:
    rows, vocab = logits.shape
    chunks = partial.shape[1]
    prefix = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    rem = torch.empty(rows, dtype=torch.float32, device=logits.device)
    opts = dict(num_warps=4) if logits.is_cuda else {}
    for shift in range(32 - BITS, -1, -BITS):
        _histogram[(rows, chunks)](logits, logits.stride(0), vocab, largest, floor, prefix, partial, SHIFT=shift,
                                   BITS=BITS, MASS=mass, CHUNK=CHUNK, **opts)
        _pick[(rows,)](partial, chunks, target, prefix, rem, FIRST=shift == 32 - BITS, MASS=mass, BITS=BITS,
                       BLOCK_P=triton.next_power_of_2(chunks), **opts)
    return prefix


def _key_to_float(key: torch.Tensor) -> torch.Tensor:
    """The float32 whose order key (as _order_key maps it) is `key` (int64 [B] holding 32-bit keys)."""
    top = 1 << 31
    bits = torch.where(key >= top, key - top, 0xFFFFFFFF - key)
    bits = torch.where(bits >= top, bits - (1 << 32), bits).to(torch.int32)
    return bits.view(torch.float32)


if triton is not None:
    @triton.jit
    def _order_key(x):
        """float32 -> int64 in [0, 2**32), in the floats' order: positive floats above negative ones, and
        among negatives the larger magnitude lower (their bits flipped)."""
        bits = x.to(tl.int32, bitcast=True)
        u = bits.to(tl.int64) & 0xFFFFFFFF
        return tl.where(bits < 0, 0xFFFFFFFF - u, u + 0x80000000)

    @triton.jit
    def _histogram(X, stride_x, V, LARGEST, FLOOR, PREFIX, PARTIAL, SHIFT: tl.constexpr, BITS: tl.constexpr,
                   MASS: tl.constexpr, CHUNK: tl.constexpr):
        """Program (row, c): over chunk c of its row, the tokens whose key starts with the row's prefix, per
        value of their next BITS bits: their count, or (MASS) their exp(logit - the row's largest). The chunk
        in one load: a loop of dependent loads costs a round trip to memory each."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        prefix = tl.load(PREFIX + row)
        floor = tl.load(FLOOR + row)
        digit = tl.arange(0, 1 << BITS)
        t = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(X + row.to(tl.int64) * stride_x + t, mask=t < V, other=0.0)
        key = _order_key(x)
        ours = (t < V) & (key >= floor) & ((key >> (SHIFT + BITS)) == prefix)
        hit = (((key >> SHIFT) & ((1 << BITS) - 1))[:, None] == digit[None, :]) & ours[:, None]
        if MASS:
            w = tl.sum(tl.where(hit, tl.exp(x - tl.load(LARGEST + row))[:, None], 0.0), axis=0)
        else:
            w = tl.sum(hit.to(tl.float32), axis=0)
        tl.store(PARTIAL + (row * tl.num_programs(1) + c).to(tl.int64) * (1 << BITS) + digit, w)

    @triton.jit
    def _pick(PARTIAL, CHUNKS, TARGET, PREFIX, REM, FIRST: tl.constexpr, MASS: tl.constexpr, BITS: tl.constexpr,
              BLOCK_P: tl.constexpr):
        """Program row: the digit holding the row's threshold, appended to its prefix; what is left of its
        target (a count, or a mass) for the tokens under the new prefix."""
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_P)
        digit = tl.arange(0, 1 << BITS)
        at = PARTIAL + (row * CHUNKS + c[:, None]).to(tl.int64) * (1 << BITS) + digit[None, :]
        w = tl.sum(tl.load(at, mask=c[:, None] < CHUNKS, other=0.0), axis=0)  # chunks summed in order
        total = tl.sum(w, axis=0)
        if FIRST:
            rem = tl.load(TARGET + row)
            if MASS:
                rem = rem * total
        else:
            rem = tl.load(REM + row)
        above = total - tl.cumsum(w, axis=0)  # what the digit values above each one hold
        # The lowest digit holding a token with less than `rem` above it. Mass 0 counts as no token: such a
        # token (more than about 87 below the largest) has nearly all the mass above it. With none left,
        # digit 0: the threshold then only has to lie below every token.
        pick = tl.min(tl.where((w > 0) & (above < rem), digit, 1 << BITS), axis=0)
        pick = tl.where(pick == (1 << BITS), 0, pick)
        rem = rem - tl.sum(tl.where(digit > pick, w, 0.0), axis=0)
        tl.store(REM + row, rem)
        tl.store(PREFIX + row, tl.load(PREFIX + row) * (1 << BITS) + pick)
