"""Top-k and top-p thresholds without a sort: each row's smallest kept logit, found digit by digit.

Sorting a 150k-token row to truncate it took most of a sampled step's extra time on an H200: top-p 0.95 made a
0.5B batch-1 step 0.75 ms against 0.55 greedy (docs/benchmarks.md, Z69), the sort, softmax, cumsum and scatter
back over the whole row. Truncation only needs one number per row, the threshold below which tokens go, and
that number can be selected rather than sorted for (a radix select).

Logits map to 32-bit keys that order as the floats do. Eight passes each fix four bits of the threshold's
key, from the top: a pass histograms the row's tokens whose key starts with the bits fixed so far by their
next four (count or softmax mass per digit value), and picks the digit holding the threshold:
- top-k (count): the digit where the count of larger tokens first reaches k; the threshold is the k-th
  largest logit;
- top-p (mass): the lowest digit with a token whose larger tokens hold less than top_p of the mass; the
  threshold is the smallest logit kept by "drop a token once the tokens ranked above it reach top_p".
Top-p under top-k counts only the tokens top-k keeps. Tokens equal to the threshold all stay (bf16 logits
tie often), as engine.sampler.sorted_top_k_top_p also keeps them. Given the rows' temperatures, the launch
divides each token by its row's as it reads it, and given min-p it raises the threshold to the row's largest
+ log(min_p) at the end: the sampler's draw kernel then drops what lies below it as it draws, and a truncated
draw is three kernels where the torch code took some fifteen (Z79). Nothing here waits for the host, so a graph
captures it.

One launch does every pass of both rules. A row is split among G programs, all resident at once (the grid
never exceeds what the SMs hold together, by the compiled kernel's registers and shared memory), which meet at
a barrier of the row's own after each pass: each leaves its partial histogram, and each then sums all G
partials in the same fixed order and picks the same digit, so no program waits for a second round and the
result does not depend on scheduling. Where programs run one after another (the interpreter), G is 1 and the
barrier is the program's own. From the second pass on, each program packs the tokens still in the running
and the next pass reads only those: after two digits few tokens share the threshold's, so a batch's later
passes cost little.

Top-p after a top-k of at most SORT_MAX tokens needs no passes: each program gathers its tokens at or above
the top-k threshold into the row's SORT_MAX slots (a counter of the row's hands out places), and after one
barrier the row's first program sorts them and applies top-p's definition to them. Where ties at the threshold
leave more than SORT_MAX tokens, the passes run as before. The two give the same thresholds to the bit (Z83).

On an H100 (docs/benchmarks.md, Z72-Z76) a launch per pass, as the first forms had, spent 8.5 us a pass on one
row and lost to the sort at 64 rows; this form takes 74 us for top-k and top-p on one 150k row (the sort 133)
and 688 us on 64 rows (the sort 1,459).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl

    from triton.language.extra import libdevice
except ImportError:  # CPU installs without triton
    triton = None

CHUNK = 1024  # tokens a program reads in one load; 512 for fewer than 16 rows (SMALL_CHUNK)
SMALL_CHUNK = 512
NUM_WARPS = 4
BITS = 4  # a pass fixes 4 bits of the key: eight passes, each comparing a token with 16 digit values
PASSES = 32 // BITS
# Top-p after a top-k of at most this many tokens (ties included) sorts them in one program instead of
# selecting digit by digit: one scan and one barrier where the passes took eight of each (0: never). On an
# H100 (Z84) top-k 50 or 200 with top-p took 52 us against 85 for one row and 329 against 636 for 64; with
# 1,024 slots the sort itself cost more than the passes it saved (Z83).
SORT_MAX = 256


def thresholds(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_top_k: bool = True,
               use_top_p: bool = True, temperature: torch.Tensor | None = None,
               min_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B]: each row keeps the logits >= its threshold (-inf where it truncates nothing: top_k <= 0,
    top_p >= 1 and min_p 0). logits float32 [B, V], rows contiguous; top_k int64 [B]; top_p float32 [B].

    With `temperature` (float32 [B]), the rules apply to logits / T (rows at T <= 0: T 1), divided as
    engine.sampler.truncated_draw divides them, and the threshold is in those units. With `min_p` (float32
    [B]), the threshold is also at least the row's largest (scaled) logit + log(min_p): p < min_p * max p,
    in logits. Top-k, top-p and min-p then cost one launch together, with the row's maximum before it."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"thresholds: logits float32 [B, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    rows, vocab = logits.shape
    for name, t in (("temperature", temperature), ("min_p", min_p)):
        if t is not None and (t.shape != (rows,) or t.dtype != torch.float32 or t.device != logits.device):
            raise ValueError(f"thresholds: {name} must be float32 [{rows}] on {logits.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    # Few rows: shorter chunks, fewer registers, a little less latency a pass (74 against 84 us for one row);
    # many rows: longer ones read the batch faster (688 against 840 us for 64).
    chunk = SMALL_CHUNK if rows < 16 else CHUNK
    chunks = triton.cdiv(vocab, chunk)
    keep = torch.empty(rows, dtype=torch.float32, device=logits.device)
    use_min_p = min_p is not None
    if rows == 0 or not (use_top_k or use_top_p or use_min_p):
        return keep.fill_(float("-inf"))
    groups = 1
    if logits.is_cuda and (use_top_k or use_top_p):  # (min-p alone has no passes: a program a row)
        # Every program of a row must be resident at once, or the row's barrier waits forever: at most as
        # many programs as the SMs hold together, by the compiled kernel's registers and shared memory.
        sms = _sm_count(logits.device)
        groups = _groups(rows, chunks, sms * 2)
        per_sm = programs_per_sm(logits.device, use_top_k, use_top_p, chunk, triton.next_power_of_2(groups),
                                 temperature is not None, use_min_p)
        if per_sm < 2:
            groups = _groups(rows, chunks, sms * per_sm)
    span = triton.cdiv(chunks, groups)
    groups = triton.cdiv(chunks, span)  # no program without a chunk
    partial = torch.empty(2, rows, groups, 1 << BITS, dtype=torch.float32, device=logits.device)
    counters = torch.zeros(2, rows, dtype=torch.int32, device=logits.device)  # barrier arrivals; survivors
    scratch = torch.empty(rows, groups * span * chunk, dtype=torch.float32, device=logits.device)
    sort_path = use_top_k and use_top_p and SORT_MAX > 0
    survivors = torch.empty(rows, SORT_MAX if sort_path else 1, dtype=torch.float32, device=logits.device)
    largest = logits.amax(dim=-1).contiguous() if use_top_p or use_min_p else keep
    opts = dict(num_warps=NUM_WARPS) if logits.is_cuda else {}
    _thresholds[(rows, groups)](
        logits, logits.stride(0), vocab, top_k.to(torch.int32).contiguous(), top_p.to(torch.float32).contiguous(),
        keep if temperature is None else temperature.contiguous(), keep if min_p is None else min_p.contiguous(),
        largest, partial, counters, counters[1], survivors, scratch, keep, span,
        USE_K=use_top_k, USE_P=use_top_p, SCALE=temperature is not None, USE_MIN_P=use_min_p,
        EXACT=logits.is_cuda, CHUNK=chunk, BITS=BITS, PASSES=PASSES, BLOCK_G=triton.next_power_of_2(groups),
        SORT_MAX=SORT_MAX, **opts)
    return keep


def _groups(rows: int, chunks: int, resident: int) -> int:
    return max(1, min(chunks, resident // max(rows, 1)))


@functools.lru_cache(maxsize=None)
def programs_per_sm(device: torch.device, use_top_k: bool, use_top_p: bool, chunk: int, block_g: int,
                    scale: bool = False, use_min_p: bool = False) -> int:
    """How many programs of this launch an SM holds at once (2 at most, the grid's bound; 1 at least: any
    kernel that launches fits one), from the compiled kernel's registers and shared memory."""
    try:
        f = torch.empty(1, dtype=torch.float32, device=device)
        i = torch.empty(1, dtype=torch.int32, device=device)
        kernel = _thresholds.warmup(f, 2, 2, i, f, f, f, f, f, i, i, f, f, f, 2, USE_K=use_top_k, USE_P=use_top_p,
                                    SCALE=scale, USE_MIN_P=use_min_p, EXACT=True, CHUNK=chunk, BITS=BITS,
                                    PASSES=PASSES, BLOCK_G=block_g, SORT_MAX=SORT_MAX, num_warps=NUM_WARPS,
                                    grid=(1,))
        kernel._init_handles()
        props = torch.cuda.get_device_properties(device)
        regs = getattr(props, "regs_per_multiprocessor", 65536)
        shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        warp_regs = -(-kernel.n_regs * 32 // 256) * 256  # registers go to warps 256 at a time
        by_regs = regs // (warp_regs * NUM_WARPS)
        by_shared = shared // (kernel.metadata.shared + 1024)  # 1 KB of each block's is the system's
        return max(1, min(2, by_regs, by_shared, 2048 // (32 * NUM_WARPS)))
    except Exception:  # a Triton without these internals: one program an SM is always safe
        return 1


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


if triton is not None:
    @triton.jit
    def _log(x, EXACT: tl.constexpr):
        if EXACT:  # the CUDA math library's logf, which torch.log calls (tl.log may lower to an approximation)
            return libdevice.log(x)
        return tl.log(x)

    @triton.jit
    def _order_key(x):
        """float32 -> uint32 in the floats' order: positive floats above negative ones, and among negatives
        the larger magnitude lower (their bits flipped)."""
        bits = x.to(tl.int32, bitcast=True)
        u = x.to(tl.uint32, bitcast=True)
        sign = tl.full(u.shape, 0x80000000, tl.uint32)
        return tl.where(bits < 0, ~u, u | sign)

    @triton.jit
    def _key_to_float(key):
        sign = tl.full(key.shape, 0x80000000, tl.uint32)
        bits = tl.where(key >= sign, key ^ sign, ~key)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _row_barrier(ARRIVED, row, target):
        """Wait until the row's G programs have all arrived `target / G` times. The CTA barrier first, so
        that every thread's stores of the partial precede the release."""
        tl.debug_barrier()
        tl.atomic_add(ARRIVED + row, 1, sem="release")
        seen = tl.atomic_add(ARRIVED + row, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(ARRIVED + row, 0, sem="acquire")

    @triton.jit
    def _scan(src, length, dst, keep_len, floor, fixed, prefix, shift, largest, temp, MASS: tl.constexpr,
              SCALE: tl.constexpr, CHUNK: tl.constexpr, BITS: tl.constexpr):
        """Over the `length` tokens at src: [16], the count (or MASS: the exp(x - largest)) of the tokens that
        are ours, per next digit; and how many are ours. Those ours among the first `keep_len` are also
        written, packed, to dst, for the next pass to read instead: after a pass or two few tokens share the
        threshold's leading digits, and the rest need not be read again. dst may be src: a token is written
        at or before its own place, and only once its chunk has been read. SCALE: the tokens at src are
        divided by temp as they are read (the row itself; what is packed is already divided)."""
        lanes = tl.arange(0, CHUNK)
        digit = tl.arange(0, 1 << BITS)
        w = tl.zeros([1 << BITS], dtype=tl.float32)
        count = tl.full([], 0, tl.int32)
        # The next chunk's load goes out before this chunk's histogram, so that a program with many chunks
        # waits for memory about once, not once a chunk.
        x = tl.load(src + lanes, mask=lanes < length, other=0.0)
        for start in range(0, length, CHUNK):
            t = start + lanes
            x_next = tl.load(src + t + CHUNK, mask=t + CHUNK < length, other=0.0)
            if SCALE:
                x = tl.math.div_rn(x, temp)
            key = _order_key(x)
            ours = (t < length) & (key >= floor) & ((key & fixed) == prefix)
            d = ((key >> shift) & ((1 << BITS) - 1)).to(tl.int32)
            hit = (d[:, None] == digit[None, :]) & ours[:, None]
            if MASS:
                w += tl.sum(tl.where(hit, tl.exp(x - largest)[:, None], 0.0), axis=0)
            else:
                w += tl.sum(hit.to(tl.float32), axis=0)
            at = count + tl.cumsum(ours.to(tl.int32), axis=0) - 1
            tl.store(dst + at, x, mask=ours & (t < keep_len))
            count += tl.sum(ours.to(tl.int32), axis=0)
            x = x_next
        return w, count

    @triton.jit
    def _gather(src, length, floor, temp, OUT, COUNT, SCALE: tl.constexpr, CHUNK: tl.constexpr,
                SORT_MAX: tl.constexpr):
        """The tokens at src (divided by temp with SCALE) whose key is >= floor, into the row's SORT_MAX slots
        at OUT, in places a counter of the row's hands out (those past SORT_MAX are counted, not kept)."""
        lanes = tl.arange(0, CHUNK)
        x = tl.load(src + lanes, mask=lanes < length, other=0.0)
        for start in range(0, length, CHUNK):
            t = start + lanes
            x_next = tl.load(src + t + CHUNK, mask=t + CHUNK < length, other=0.0)
            if SCALE:
                x = tl.math.div_rn(x, temp)
            hit = (t < length) & (_order_key(x) >= floor)
            n = tl.sum(hit.to(tl.int32), axis=0)
            if n > 0:
                at = tl.atomic_add(COUNT, n, sem="relaxed") + tl.cumsum(hit.to(tl.int32), axis=0) - 1
                tl.store(OUT + at, x, mask=hit & (at < SORT_MAX))
            x = x_next

    @triton.jit
    def _sorted_top_p(BUF, count, largest, top_p, SORT_MAX: tl.constexpr):
        """The smallest of the `count` values at BUF that top-p keeps, by the sorted definition: a token
        goes once the tokens ranked above it hold top_p of their mass; equal values all stay or all go."""
        i = tl.arange(0, SORT_MAX)
        v = tl.load(BUF + i, mask=i < count, other=float("-inf"), cache_modifier=".cg")
        v = tl.sort(v, descending=True)
        mass = tl.where(i < count, tl.exp(v - largest), 0.0)
        above = tl.cumsum(mass, axis=0) - mass
        kept = (i < count) & ((above < top_p * tl.sum(mass, axis=0)) | (i == 0))
        return tl.min(tl.where(kept, v, float("inf")), axis=0)

    @triton.jit
    def _select(X, stride_x, V, row, g, groups, span, largest, temp, floor, target, PARTIAL, ARRIVED, SCRATCH,
                phase0, MASS: tl.constexpr, SCALE: tl.constexpr, CHUNK: tl.constexpr, BITS: tl.constexpr,
                PASSES: tl.constexpr, BLOCK_G: tl.constexpr):
        """The key of the row's threshold for one rule (count: `target` is k; MASS: `target` is top_p),
        among the tokens whose key is >= floor. Barriers phase0 + 1 .. phase0 + PASSES."""
        rows = tl.num_programs(0)
        digit = tl.arange(0, 1 << BITS)
        gs = tl.arange(0, BLOCK_G)
        prefix = tl.full([], 0, tl.uint32)  # the fixed digits, in place
        fixed = tl.full([], 0, tl.uint32)  # a mask of the bits they hold
        rem = target
        first = g * span * CHUNK  # this program's tokens of the row
        mine = tl.minimum((g + 1) * span * CHUNK, V) - first
        src = X + row.to(tl.int64) * stride_x + first
        packed = SCRATCH + (row * groups + g).to(tl.int64) * span * CHUNK  # its candidates, packed
        n = mine
        for i in range(PASSES):
            shift = tl.cast(32 - BITS - BITS * i, tl.uint32)
            # Passes 0 and 1 read the row; pass 1 packs its tokens that are ours, and each later pass reads
            # what the one before packed and packs it again.
            if i < 2:
                w, n = _scan(src, mine, packed, mine * tl.minimum(i, 1), floor, fixed, prefix, shift, largest,
                             temp, MASS, SCALE, CHUNK, BITS)
            else:
                w, n = _scan(packed, n, packed, n, floor, fixed, prefix, shift, largest, temp, MASS, False, CHUNK,
                             BITS)
            buf = (phase0 + i) % 2  # a program a pass ahead writes the other buffer
            tl.store(PARTIAL + ((buf * rows + row) * groups + g).to(tl.int64) * (1 << BITS) + digit, w)
            _row_barrier(ARRIVED, row, (phase0 + i + 1) * groups)
            at = PARTIAL + ((buf * rows + row) * groups + gs[:, None]).to(tl.int64) * (1 << BITS) + digit[None, :]
            w = tl.sum(tl.load(at, mask=gs[:, None] < groups, other=0.0, cache_modifier=".cg"), axis=0)
            total = tl.sum(w, axis=0)
            if i == 0:
                if MASS:
                    rem = rem * total
            above = total - tl.cumsum(w, axis=0)  # what the digit values above each one hold
            # The lowest digit holding a token with less than `rem` above it. Mass 0 counts as no token: such
            # a token (more than about 87 below the largest) has nearly all the mass above it. With none left,
            # digit 0: the threshold then only has to lie below every token.
            pick = tl.min(tl.where((w > 0) & (above < rem), digit, 1 << BITS), axis=0)
            pick = tl.where(pick == (1 << BITS), 0, pick)
            rem = rem - tl.sum(tl.where(digit > pick, w, 0.0), axis=0)
            prefix = prefix | (pick.to(tl.uint32) << shift)
            fixed = fixed | (tl.full([], (1 << BITS) - 1, tl.uint32) << shift)
        return prefix

    @triton.jit
    def _thresholds(X, stride_x, V, TOP_K, TOP_P, TEMP, MIN_P, LARGEST, PARTIAL, ARRIVED, COUNT, SURVIVORS,
                    SCRATCH, KEEP, span, USE_K: tl.constexpr, USE_P: tl.constexpr, SCALE: tl.constexpr,
                    USE_MIN_P: tl.constexpr, EXACT: tl.constexpr, CHUNK: tl.constexpr, BITS: tl.constexpr,
                    PASSES: tl.constexpr, BLOCK_G: tl.constexpr, SORT_MAX: tl.constexpr):
        """Program (row, g): chunks g*span .. of its row, through every pass of top-k, then of top-p; the
        min-p floor last. A row whose top-k keeps at most SORT_MAX tokens takes top-p over those by sorting
        them: each program gathers its part of them, and after one barrier the row's first program sorts."""
        row = tl.program_id(0)
        g = tl.program_id(1)
        groups = tl.num_programs(1)
        temp = 1.0
        if SCALE:
            temp = tl.load(TEMP + row)
            temp = tl.where(temp > 0, temp, 1.0)
        largest = 0.0
        if USE_P or USE_MIN_P:
            # Division by a positive number keeps the order, and rounding is monotonic: the largest divided
            # is the largest of the divided.
            largest = tl.load(LARGEST + row)
            if SCALE:
                largest = tl.math.div_rn(largest, temp)
        keep = tl.full([], float("-inf"), tl.float32)
        floor = tl.full([], 0, tl.uint32)
        if USE_K:
            k = tl.load(TOP_K + row)
            key = _select(X, stride_x, V, row, g, groups, span, 0.0, temp, floor, k.to(tl.float32), PARTIAL,
                          ARRIVED, SCRATCH, 0, False, SCALE, CHUNK, BITS, PASSES, BLOCK_G)
            floor = tl.where(k > 0, key, floor)
            keep = tl.where(k > 0, _key_to_float(key), keep)
        if USE_P:
            p = tl.load(TOP_P + row)
            phase0 = tl.full([], PASSES if USE_K else 0, tl.int32)
            passes = tl.full([], 1, tl.int32)
            if USE_K and SORT_MAX > 0:
                if (k > 0) & (k <= SORT_MAX) & (p < 1.0):  # the same for all of a row's programs
                    first = g * span * CHUNK
                    mine = tl.minimum((g + 1) * span * CHUNK, V) - first
                    _gather(X + row.to(tl.int64) * stride_x + first, mine, floor, temp, SURVIVORS + row * SORT_MAX,
                            COUNT + row, SCALE, CHUNK, SORT_MAX)
                    _row_barrier(ARRIVED, row, (PASSES + 1) * groups)
                    phase0 += 1
                    count = tl.atomic_add(COUNT + row, 0, sem="acquire")
                    if count <= SORT_MAX:
                        passes = 0
                        if g == 0:
                            keep = tl.maximum(keep, _sorted_top_p(SURVIVORS + row * SORT_MAX, count, largest, p,
                                                                  SORT_MAX))
            if passes:
                key = _select(X, stride_x, V, row, g, groups, span, largest, temp, floor, p, PARTIAL,
                              ARRIVED, SCRATCH, phase0, True, SCALE, CHUNK, BITS, PASSES, BLOCK_G)
                keep = tl.where(p < 1.0, tl.maximum(keep, _key_to_float(key)), keep)
        if USE_MIN_P:
            # engine.sampler's floor, term for term: the largest + log(min_p) (min_p 0: -inf, nothing dropped).
            # The largest token survives top-k and top-p, so the largest after them is this one.
            keep = tl.maximum(keep, largest + _log(tl.load(MIN_P + row), EXACT))
        if g == 0:
            tl.store(KEEP + row, keep)
