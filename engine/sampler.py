"""Batched sampling on the device: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Every request's randomness comes from a counter-based hash of (seed, output position, token id), so a seeded
request draws the same tokens whatever else shares its batch, and after a retraction and recompute. The draw
is Gumbel-max: the argmax of logits / T - log(-log u), which samples exactly from softmax(logits / T) and needs
neither a sort nor the softmax. Truncation (top-k, top-p, min-p) sets the logits it drops to -inf first. On a
GPU the draw is one Triton kernel (kernels/step_tokens.py), which computes the same expression term for term;
a decode graph ends in it, so a batch that only sets temperatures needs no sampling work after the graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.env import Env
from kernels.step_tokens import counters_for, sample_tokens, triton
from kernels.truncation import thresholds

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on int64 tensors holding 32-bit values; products wrap, the mask keeps the low bits.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64) to float32 strictly inside (0, 1): (k + 0.5) / 2**23, k their top 23 bits.
    Not 24 bits: the largest, 1 - 2**-25, rounds to 1.0 in float32, whose Gumbel noise -log(-log 1) is +inf.
    One token in 2**24 then won its row's draw whatever its probability, and a token truncation had set to
    -inf became NaN, which wins an argmax: about one sampled token in a hundred (a 150k vocabulary), out of
    the vocabulary altogether on the device, whose last chunk pads the row with -inf."""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1) (unit_interval), [B, vocab], a pure function of (seed, step, token id)."""
    seeds = seeds.long()
    key = _fmix32((seeds & _M32) ^ _fmix32(((seeds >> 32) & _M32) ^ _fmix32(steps.long() & _M32)))
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    h = _fmix32(key[:, None] ^ ((idx * 0x9E3779B1) & _M32)[None, :])
    h = _fmix32(h ^ key[:, None])
    return unit_interval(h)


def draw(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [B, V] float32: argmax(logits / T - log(-log u)) where T > 0, argmax(logits)
    where T == 0 (temperature float32 [B]; seeds, steps int64 [B])."""
    if logits.is_cuda and triton is not None:
        return sample_tokens(logits.contiguous(), counters_for(logits.shape[0], logits.device), temperature,
                             seeds.contiguous(), steps.contiguous())
    hot = temperature > 0
    t = torch.where(hot, temperature, torch.ones_like(temperature))
    score = logits / t[:, None] - torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))
    return argmax_rows(torch.where(hot[:, None], score, logits))


def truncated_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, use_top_k: bool = True,
                   use_top_p: bool = True, use_min_p: bool = True, fused: bool | None = None) -> torch.Tensor:
    """One token per row: drawn at the row's temperature after its top-k, top-p and min-p truncation, or the
    argmax of the logits where the temperature is 0. A row is truncated by its own parameters alone (top_k 0,
    top_p 1 and min_p 0 truncate nothing, whatever the other rows ask); the flags skip a rule no row asks for.
    No host synchronisation, so a decode graph can capture it (engine/graph.py).

    On a GPU (`fused` None; True forces it under the interpreter, False the torch code) this is two kernels
    after the row maxima: one threshold per row for all three rules (kernels/truncation.py), then the draw,
    which divides by the temperature and drops what lies below the threshold as it reads the row
    (kernels/step_tokens.py). The torch code below computes the same thing in some fifteen launches."""
    if fused is None:
        fused = logits.is_cuda and triton is not None and Env.select_truncation()
    if fused:
        logits, temperature = logits.float().contiguous(), temperature.float().contiguous()
        floor = thresholds(logits, top_k, top_p, use_top_k, use_top_p, temperature,
                           min_p.float().contiguous() if use_min_p else None)
        return sample_tokens(logits, counters_for(logits.shape[0], logits.device), temperature,
                             seeds.long().contiguous(), steps.long().contiguous(), floor=floor)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp[:, None]
    if use_top_k or use_top_p:
        scaled = _top_k_top_p(scaled, top_k, top_p, use_top_k, use_top_p)
    if use_min_p:
        # p < min_p * max p, in logits: below the row's largest by more than -log(min_p) (min_p 0: none).
        floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    # Truncated rows draw at temperature 1 from the scaled logits: the same draw as at T from the logits.
    return torch.where(temperature > 0, draw(scaled, torch.ones_like(temp), seeds, steps), argmax_rows(logits))


def plain_draw(r) -> bool:
    """Whether request r's next token depends on its temperature alone (and its seed): no truncation, no
    penalties, no logprobs, no stop ids held back by min_tokens. A decode graph draws such tokens itself."""
    p = r.params
    untruncated = p.temperature == 0 or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)
    return untruncated and truncating_draw(r)


def truncating_draw(r) -> bool:
    """Whether request r's next token is a draw from its logits as they are, truncated or not (no penalties,
    no logprobs, no stop ids held back by min_tokens): a decode graph can draw it (engine.graph)."""
    p = r.params
    return not p.changes_logits and p.logprobs is None and r.num_output + r.pending >= p.min_tokens


def draw_index(r) -> int:
    """The index of the token r draws next, counted from the start of the generation it continues."""
    return r.num_output + r.pending + r.params.output_offset


@dataclass
class SamplingBatch:
    """The batch's parameters as device tensors, built once per step from its requests."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    seeds: torch.Tensor  # [B] long
    steps: torch.Tensor  # [B] long, tokens generated so far
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    # Penalties (None when no request has any): token counts over the output and a mask of prompt tokens.
    rep_penalty: torch.Tensor | None = None
    freq_penalty: torch.Tensor | None = None
    pres_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # [B, V] float
    prompt_mask: torch.Tensor | None = None  # [B, V] bool
    # (row, token) pairs whose logits are banned this step (EOS before min_tokens).
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    # (row, token, bias) triples added to the logits first (logit_bias).
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    max_logprobs: int = -1  # -1: no request wants logprobs

    @classmethod
    def build(cls, reqs, vocab: int, device) -> "SamplingBatch":
        ps = [r.params for r in reqs]

        def t(vals, dtype):
            return torch.tensor(vals, dtype=dtype, device=device)

        # One copy per dtype from pinned memory, which does not wait for the step in flight (a tensor made from
        # a list on the device waits for the stream: six of them made a sampled 0.5B step three times slower).
        n = len(reqs)
        floats = torch.tensor([p.temperature for p in ps] + [p.top_p for p in ps] + [p.min_p for p in ps],
                              dtype=torch.float32)
        longs = torch.tensor([p.top_k for p in ps] + [r.seed for r in reqs] + [draw_index(r) for r in reqs],
                             dtype=torch.long)
        if torch.device(device).type == "cuda":
            floats = floats.pin_memory().to(device, non_blocking=True)
            longs = longs.pin_memory().to(device, non_blocking=True)
        b = cls(
            temperature=floats[:n],
            top_k=longs[:n],
            top_p=floats[n:2 * n],
            min_p=floats[2 * n:],
            seeds=longs[n:2 * n],
            steps=longs[2 * n:],
            all_greedy=all(p.greedy for p in ps),
            use_top_k=any(p.top_k > 0 and not p.greedy for p in ps),
            use_top_p=any(p.top_p < 1.0 and not p.greedy for p in ps),
            use_min_p=any(p.min_p > 0 and not p.greedy for p in ps),
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
        )
        if any(p.has_penalties for p in ps):
            b.rep_penalty = t([p.repetition_penalty for p in ps], torch.float32)
            b.freq_penalty = t([p.frequency_penalty for p in ps], torch.float32)
            b.pres_penalty = t([p.presence_penalty for p in ps], torch.float32)
            b.output_counts = _counts([r.output_ids for r in reqs], vocab, device)
            b.prompt_mask = _counts([r.prompt_ids for r in reqs], vocab, device) > 0
        banned = [(i, tok) for i, r in enumerate(reqs) if r.num_output + r.pending < r.params.min_tokens
                  for tok in r.stop_ids]
        if banned:
            b.banned_rows = t([i for i, _ in banned], torch.long)
            b.banned_tokens = t([tok for _, tok in banned], torch.long)
        biased = [(i, tok, v) for i, p in enumerate(ps) if p.logit_bias for tok, v in p.logit_bias.items()]
        if biased:
            b.bias_rows = t([i for i, _, _ in biased], torch.long)
            b.bias_tokens = t([tok for _, tok, _ in biased], torch.long)
            b.bias_values = t([v for _, _, v in biased], torch.float32)
        return b


def _counts(seqs: list[list[int]], vocab: int, device) -> torch.Tensor:
    counts = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=device)
    rows = [i for i, s in enumerate(seqs) for _ in s]
    if rows:
        ids = torch.tensor([tok for s in seqs for tok in s], dtype=torch.long, device=device)
        counts.index_put_((torch.tensor(rows, device=device), ids), torch.ones_like(ids, dtype=torch.float32),
                          accumulate=True)
    return counts


@functools.lru_cache(maxsize=None)
def _chunk_for(vocab: int) -> int:
    """The divisor of `vocab` in [256, 4096] that keeps the longer of the two rounds shortest, or 0."""
    chunks = [c for c in range(256, 4097) if vocab % c == 0]
    return min(chunks, key=lambda c: max(c, vocab // c)) if chunks else 0


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [B, V], the same indices (the first of equal maxima), in two rounds. A
    reduction of one long row runs in a single block on CUDA: 27 us for a 128k vocabulary on an H200, 1 %
    of an 8B decode step. Rows cut into chunks of about sqrt(V) spread the first round over the GPU."""
    b, v = logits.shape
    chunk = _chunk_for(v) if v >= 65536 else 0
    if not chunk:
        return logits.argmax(dim=-1)
    vals, idx = logits.view(b, v // chunk, chunk).max(dim=-1)
    first = vals.argmax(dim=-1, keepdim=True)  # the first chunk holding the maximum
    return (first * chunk + idx.gather(1, first)).squeeze(1)


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor | None = None  # [B] chosen token's logprob
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]


def sample(logits: torch.Tensor, b: SamplingBatch) -> SampleOutput:
    """logits [B, V] float32 -> one token per row."""
    raw = logits
    if b.bias_rows is not None:
        logits = logits.index_put((b.bias_rows, b.bias_tokens), b.bias_values.to(logits.dtype), accumulate=True)
    if b.output_counts is not None:
        seen = b.prompt_mask | (b.output_counts > 0)
        rp = b.rep_penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        logits = logits - b.freq_penalty[:, None] * b.output_counts
        logits = logits - b.pres_penalty[:, None] * (b.output_counts > 0).float()
    if b.banned_rows is not None:
        logits = logits.index_put((b.banned_rows, b.banned_tokens), torch.tensor(float("-inf"), device=logits.device))
    if b.all_greedy:
        tokens = argmax_rows(logits)
    elif not (b.use_top_k or b.use_top_p or b.use_min_p):
        tokens = draw(logits, b.temperature, b.seeds, b.steps)
    else:
        tokens = truncated_draw(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps, b.use_top_k,
                                b.use_top_p, b.use_min_p)
    out = SampleOutput(tokens=tokens)
    if b.max_logprobs >= 0:
        # Logprobs of the model's own distribution, before penalties and truncation (as vLLM reports them).
        lp = raw.log_softmax(dim=-1)
        out.logprobs = lp.gather(1, tokens[:, None]).squeeze(1)
        if b.max_logprobs > 0:
            out.top_logprobs, out.top_ids = lp.topk(b.max_logprobs, dim=-1)
    return out


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_top_k: bool = True,
                 use_top_p: bool = True) -> torch.Tensor:
    if logits.is_cuda and triton is not None and Env.select_truncation():
        # The same tokens kept, selected rather than sorted for (kernels/truncation.py).
        logits = logits.float().contiguous()
        keep = thresholds(logits, top_k, top_p, use_top_k, use_top_p)
        return logits.masked_fill(logits < keep[:, None], float("-inf"))
    return sorted_top_k_top_p(logits, top_k, top_p, use_top_k, use_top_p)


def sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_top_k: bool = True,
                       use_top_p: bool = True) -> torch.Tensor:
    """Top-k and top-p by their definition on the sorted row: the CPU's way, and the GPU's reference. Tokens
    tied with the smallest one kept stay too (bf16 logits tie often, and which of two equal tokens a sort
    puts first is arbitrary): top-k keeps every token equal to the k-th largest, and top-p, with a row's
    tied tokens in any order, keeps them all once one of them stays."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_top_k:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
        remove |= sorted_logits < sorted_logits.gather(1, (k - 1)[:, None])
    if use_top_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Drop a token once the tokens ranked above it already reach top_p; the first token always stays. A row
        # at top_p 1 drops nothing (its sum's rounding could otherwise reach 1 before the tail).
        remove |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    smallest = sorted_logits.masked_fill(remove, float("inf")).amin(dim=-1, keepdim=True)
    return logits.masked_fill(logits < smallest, float("-inf"))
