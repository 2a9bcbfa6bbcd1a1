"""The batched sampler, on hand-made logits."""

from __future__ import annotations


import pytest
import torch

from engine.request import Request
from engine.sampler import SamplingBatch, argmax_rows, sample, uniform_noise, unit_interval
from engine.sampling_params import SamplingParams


def reqs(params, seeds=None, outputs=None, prompts=None):
    out = []
    for i, p in enumerate(params):
        prompt = list((prompts or [[]] * len(params))[i])
        r = Request(rid=str(i), prompt_ids=prompt, params=p, seed=(seeds or [0] * len(params))[i], stop_ids=(2,),
                    max_len=1 << 20)
        r.tokens = prompt + list((outputs or [[]] * len(params))[i])
        out.append(r)
    return out


def draw(logits, params, n=1, **kw):
    """n draws per row, at successive output positions."""
    out = []
    for step in range(n):
        rs = reqs(params, **kw)
        for r in rs:
            r.tokens = r.prompt_ids + [0] * step
        out.append(sample(logits, SamplingBatch.build(rs, logits.shape[1], "cpu")).tokens)
    return torch.stack(out, dim=1)


def test_greedy_rows_take_the_argmax_beside_random_rows():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=1)]
    tok = draw(logits, params, seeds=[1, 2, 3, 4])[:, 0]
    assert tok[0] == logits[0].argmax() and tok[2] == logits[2].argmax() and tok[3] == logits[3].argmax()


@pytest.mark.parametrize("vocab", [128256, 151936, 65537])
def test_argmax_in_two_rounds_is_the_argmax_with_its_tie_rule(vocab):
    """Real vocabularies (Llama 3, Qwen2.5) are cut into chunks; a prime one falls back to one round. Equal
    maxima in several chunks, and twice in one chunk, resolve to the first, as torch.argmax does."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=g)
    logits[1, [vocab - 5, 7000, 900, 901]] = 50.0  # row 1: ties across chunks and inside the first chunk
    logits[2, -1] = 60.0  # row 2: the very last token
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[1] == 900 and argmax_rows(logits)[2] == vocab - 1


def test_draws_follow_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    p = SamplingParams(temperature=1.0)
    toks = torch.cat([draw(logits, [p], n=500, seeds=[s]) for s in range(8)], dim=1)[0]
    freq = torch.bincount(toks, minlength=5).float() / toks.numel()
    expect = logits[0].softmax(-1)
    assert (freq - expect).abs().max() < 0.03
    assert freq[4] == 0


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05]]))
    cases = [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.65), {0, 1}),
             (SamplingParams(top_p=0.75), {0, 1, 2}), (SamplingParams(min_p=0.6), {0, 1})]
    for params, support in cases:
        toks = draw(logits, [params], n=300, seeds=[5])[0]
        assert set(toks.tolist()) == support, params


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    cold = draw(logits, [SamplingParams(temperature=0.2)], n=300, seeds=[1])[0]
    hot = draw(logits, [SamplingParams(temperature=2.0)], n=300, seeds=[1])[0]
    assert (cold == 0).float().mean() > 0.95 > (hot == 0).float().mean()


def test_penalties_push_down_seen_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    greedy_rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert draw(logits, [greedy_rep], prompts=[[0]])[0, 0] == 1
    freq = SamplingParams(temperature=0, frequency_penalty=0.2)
    # output_ids are overwritten per step in draw(); use the batch builder directly for counts.
    rs = reqs([freq], outputs=[[0]])
    assert sample(logits, SamplingBatch.build(rs, 4, "cpu")).tokens[0] == 1
    pres = SamplingParams(temperature=0, presence_penalty=0.05)
    rs = reqs([pres], outputs=[[0, 0, 0]])
    assert sample(logits, SamplingBatch.build(rs, 4, "cpu")).tokens[0] == 0  # 3.0-0.05 > 2.9


def test_min_tokens_bans_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0]])  # token 2 is the stop id in reqs()
    p = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    assert draw(logits, [p])[0, 0] != 2
    rs = reqs([p], outputs=[[1, 1]])
    assert sample(logits, SamplingBatch.build(rs, 4, "cpu")).tokens[0] == 2


def test_noise_is_a_function_of_seed_and_step_only():
    a = uniform_noise(torch.tensor([7, 8]), torch.tensor([3, 3]), 1000)
    b = uniform_noise(torch.tensor([7]), torch.tensor([3]), 1000)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1])
    assert 0 < a.min() and a.max() < 1
    assert abs(a.mean().item() - 0.5) < 0.03
    ends = unit_interval(torch.tensor([0, 2**32 - 1]))  # the smallest and largest hash
    assert 0 < ends[0] and ends[1] < 1 and torch.isfinite(-torch.log(-torch.log(ends))).all()


def test_a_draw_never_takes_a_token_its_noise_cannot_give():
    """The Gumbel noise stays finite. When it could round to u = 1 (+inf noise), the rows below drew that token
    whatever its logit: a finite one over a token 30 above it, a -inf one (NaN wins an argmax), and on the device
    a lane past the vocabulary, which its last chunk pads with -inf (seeds 1, 15, 150, 156 and 171 at the first
    draw over 151,936 tokens; 11958, 15260 and 26165 over 1000). A token 30 above the rest, beside -inf and
    zeros, must win each row, in the sampler's torch code and in the kernel a decode graph ends in."""
    from engine.sampler import draw
    from kernels.step_tokens import counters_for, sample_tokens

    for vocab, seeds in ((151936, [0, 1, 15, 150, 156, 171]), (1000, [11958, 15260, 26165])):
        n = len(seeds)
        logits = torch.zeros(n, vocab)
        logits[:, 1::2] = float("-inf")
        logits[:, 10] = 30.0
        args = (torch.ones(n), torch.tensor(seeds), torch.zeros(n, dtype=torch.long))
        assert draw(logits, *args).tolist() == [10] * n
        assert sample_tokens(logits, counters_for(n, logits.device), *args).tolist() == [10] * n


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 1.5), ("top_k", -3), ("n", 0),
                                          ("logprobs", 50), ("max_tokens", 0), ("min_p", 2.0),
                                          ("skip_special_tokens", 1), ("ignore_eos", "yes"),
                                          ("include_stop_str_in_output", [])])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("vocab,dtype", [(151936, torch.float32), (65537, torch.float32), (5000, torch.bfloat16)])
def test_device_argmax_is_torch_argmax_with_its_tie_rule(vocab, dtype):
    """The greedy kernel a decode graph ends in (run here by Triton's interpreter): ties across chunks and
    inside one chunk resolve to the first index; a row of -inf is token 0; NaN wins. The same counters serve
    the next launch."""
    from kernels.step_tokens import CHUNK, argmax_tokens, counters_for

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    logits[1, [vocab - 3, CHUNK + 5, 1030, 4]] = 40.0  # ties across chunks and inside the first
    logits[1, 3] = 39.0
    logits[2] = float("-inf")
    logits[3, -1] = 50.0
    logits[4, [17, vocab // 2]] = float("nan")
    logits[5, :] = 1.0  # all equal: token 0
    counters = counters_for(8, logits.device)
    for _ in range(2):
        got = argmax_tokens(logits, counters)
        assert got.dtype == torch.int64
        assert got.tolist() == logits.float().argmax(dim=-1).tolist()
        assert got[1] == 4 and got[2] == 0 and got[3] == vocab - 1 and got[4] == 17
        assert counters.eq(0).all()


def test_device_argmax_refuses_bad_shapes():
    from kernels.step_tokens import argmax_tokens, counters_for

    with pytest.raises(ValueError):
        argmax_tokens(torch.zeros(4), counters_for(4, torch.device("cpu")))
    with pytest.raises(ValueError):
        argmax_tokens(torch.zeros(4, 10), counters_for(2, torch.device("cpu")))
    with pytest.raises(ValueError):
        argmax_tokens(torch.zeros(10, 4).t(), counters_for(4, torch.device("cpu")))


def test_fill_tokens_takes_the_previous_steps_tokens_where_a_row_waits_for_one():
    from kernels.step_tokens import fill_tokens

    ids = torch.tensor([5, 0, 7, 0, 9], dtype=torch.int64)
    fill_tokens(ids, torch.tensor([-1, 2, -1, 0, -1]), torch.tensor([11, 12, 13], dtype=torch.int64))
    assert ids.tolist() == [5, 13, 7, 11, 9]
    with pytest.raises(ValueError):
        fill_tokens(ids, torch.tensor([-1, 2]), torch.tensor([11], dtype=torch.int64))


def test_device_draw_is_the_samplers_draw_term_for_term():
    """The kernel a decode graph ends in draws at each row's temperature (run here by Triton's interpreter):
    the same tokens as the sampler's torch code for the same (seed, draw index), greedy rows at T = 0, a NaN
    logit winning as in torch, and the counters left at zero for the next launch."""
    from engine.sampler import draw
    from kernels.step_tokens import counters_for, sample_tokens

    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 5000, generator=g) * 3
    logits[3, 100:] = float("-inf")
    logits[4, 77] = float("nan")
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.9, 2.0])
    seeds = torch.tensor([1, 2, 3, -(2**62), 5, 2**62 + 7])
    counters = counters_for(6, logits.device)
    seen = set()
    for step in range(3):
        steps = torch.full((6,), step, dtype=torch.long)
        got = sample_tokens(logits, counters, temperature, seeds, steps)
        ref = draw(logits, temperature, seeds, steps)  # (the torch path on a CPU)
        assert got.tolist() == ref.tolist()
        assert got[0] == logits[0].argmax() and got[3] < 100 and got[4] == 77 and counters.eq(0).all()
        seen.add(tuple(got.tolist()))
    assert len(seen) > 1, "another draw index, other tokens"


def test_device_draws_follow_the_softmax_at_the_temperature():
    from kernels.step_tokens import counters_for, sample_tokens

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0]).repeat(1200, 1)
    t = 0.8
    toks = sample_tokens(logits, counters_for(1200, logits.device), torch.full((1200,), t),
                         torch.arange(1200) % 3, torch.arange(1200) // 3)
    freq = torch.bincount(toks, minlength=5).float() / toks.numel()
    assert (freq - (logits[0] / t).softmax(-1)).abs().max() < 0.04 and freq[4] == 0


def test_truncation_that_drops_nothing_draws_what_temperature_alone_draws():
    """top-k over the whole vocabulary takes the truncating path; the draw must not change."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 300, generator=g)
    plain = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.5), SamplingParams(temperature=0)]
    wide = [SamplingParams(temperature=0.8, top_k=300), SamplingParams(temperature=1.5, top_k=300),
            SamplingParams(temperature=0, top_k=5)]
    a = draw(logits, plain, n=20, seeds=[4, 5, 6])
    b = draw(logits, wide, n=20, seeds=[4, 5, 6])
    assert torch.equal(a, b)


def test_device_draw_refuses_bad_parameters():
    from kernels.step_tokens import counters_for, sample_tokens

    logits, counters = torch.zeros(2, 10), counters_for(2, torch.device("cpu"))
    longs = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError):
        sample_tokens(logits, counters, torch.ones(3), longs, longs)
    with pytest.raises(ValueError):
        sample_tokens(logits, counters, torch.ones(2, dtype=torch.float64), longs, longs)
    with pytest.raises(ValueError):
        sample_tokens(logits, counters, torch.ones(2), longs.int(), longs)
    with pytest.raises(ValueError):
        sample_tokens(logits, counters, torch.ones(2), None, longs)


def test_top_k_and_top_p_keep_what_the_sorted_definition_keeps():
    """Against the definition on a sorted row: top-k keeps the k largest; top-p then keeps each token whose
    higher-ranked tokens (among those) hold less than top_p of their mass. Rows in one batch keep their own
    settings, and a row at top_p 1 without top-k keeps every token."""
    from engine.sampler import _top_k_top_p

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 4000, generator=g) * 2
    params = [SamplingParams(top_k=7), SamplingParams(top_p=0.5), SamplingParams(top_k=300, top_p=0.9),
              SamplingParams(), SamplingParams(top_k=1)]
    b = SamplingBatch.build(reqs(params), 4000, "cpu")
    got = _top_k_top_p(logits, b.top_k, b.top_p)
    for row, p in enumerate(params):
        ranked = logits[row].sort(descending=True).values
        keep = p.top_k or 4000
        probs = ranked[:keep].softmax(-1)
        keep = min(keep, int(((probs.cumsum(-1) - probs) < p.top_p).sum()) if p.top_p < 1 else keep)
        expect = logits[row] >= ranked[keep - 1]
        assert torch.equal(torch.isfinite(got[row]), expect), p
        assert torch.equal(got[row][expect], logits[row][expect])


def test_the_sort_free_thresholds_keep_what_the_sorted_definition_keeps():
    """kernels/truncation.py (the GPU's top-k and top-p) selects each row's threshold digit by digit, or sorts
    what a top-k of at most SORT_MAX tokens keeps; the tokens at or above it are those the sorted definition
    keeps, for top-k alone, top-p alone, both, neither, a k beyond the row, negative and -inf logits, ties at
    the threshold (all kept), a row of one value, a row with one finite token, and rows of whole numbers: a
    top-k under SORT_MAX (sorted), one whose ties take it past SORT_MAX (selected after the gather), and one
    over it."""
    from engine.sampler import sorted_top_k_top_p
    from kernels.truncation import SORT_MAX, thresholds

    g = torch.Generator().manual_seed(5)
    vocab = 5000  # loads of 512 tokens, the last one partly past the row
    logits = torch.randn(9, vocab, generator=g) * 3 - 1
    logits[3, :100] = float("-inf")
    logits[4, torch.randperm(vocab, generator=g)[:5]] = logits[4].max() + 1  # five tied at the top
    logits[7] = 0.25
    logits[8] = float("-inf")
    logits[8, 4321] = -3.0
    # Whole numbers: top-k 60 keeps every token tied with the 60th (about a hundred), and top-p cuts a tie.
    # Two more rows of distinct values whose top-k is sorted (at most SORT_MAX), then the whole numbers.
    logits = torch.cat([logits, torch.randn(2, vocab, generator=g) * 3, (torch.randn(3, vocab, generator=g) * 2).round()])
    params = [SamplingParams(top_k=7), SamplingParams(top_p=0.5), SamplingParams(top_k=300, top_p=0.9),
              SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_k=vocab + 10, top_p=0.99),
              SamplingParams(top_p=0.05), SamplingParams(top_k=3, top_p=0.5), SamplingParams(top_k=2, top_p=0.3),
              SamplingParams(top_k=200, top_p=0.9), SamplingParams(top_k=40, top_p=0.6),
              SamplingParams(top_k=60, top_p=0.8), SamplingParams(top_k=SORT_MAX - 6, top_p=0.95),
              SamplingParams(top_k=4 * SORT_MAX, top_p=0.95)]
    ties = [int((logits[r] >= logits[r].sort(descending=True).values[params[r].top_k - 1]).sum()) for r in (11, 12)]
    assert ties[0] <= SORT_MAX < ties[1], ties
    b = SamplingBatch.build(reqs(params), vocab, "cpu")
    keep = thresholds(logits, b.top_k, b.top_p)
    for row, p in enumerate(params[:11]):  # (rows of distinct values at the cut: k tokens are the top-k)
        ranked = logits[row].sort(descending=True).values
        k = min(p.top_k or vocab, vocab)
        probs = ranked[:k].softmax(-1)
        k = min(k, int(((probs.cumsum(-1) - probs) < p.top_p).sum()) if p.top_p < 1 else k)
        assert torch.equal(logits[row] >= keep[row], logits[row] >= ranked[k - 1]), p
    assert torch.equal(logits.masked_fill(logits < keep[:, None], float("-inf")),
                       sorted_top_k_top_p(logits, b.top_k, b.top_p)), "the CPU's sorted path keeps the same tokens"
    assert keep[3] == float("-inf"), "a row that truncates nothing keeps every token"
    assert (logits[4] >= keep[4]).sum() == 5, "top-k 3 among five equal largest keeps all five"
    assert (logits[6] >= keep[6]).sum() < (logits[1] >= keep[1]).sum()
    assert (logits[7] >= keep[7]).all(), "a row of one value ties throughout: all of it stays"
    assert torch.isfinite(logits[8]).logical_and(logits[8] >= keep[8]).nonzero().flatten().tolist() == [4321]
    # Only the rule asked for runs: without top-p the top-p rows keep everything top-k leaves.
    only_k = thresholds(logits, b.top_k, b.top_p, use_top_p=False)
    assert only_k[1] == float("-inf") and only_k[0] == keep[0]


def test_a_rows_truncation_does_not_depend_on_its_neighbours():
    """A row draws the same token alone as beside rows that truncate (top-k, top-p, min-p): each row is
    truncated by its own parameters only."""
    from engine.sampler import truncated_draw

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 3000, generator=g) * 4
    t = torch.tensor([1.0, 0.7, 1.2, 0.0])
    k = torch.tensor([0, 40, 0, 0])
    p = torch.tensor([1.0, 1.0, 0.8, 1.0])
    m = torch.tensor([0.0, 0.0, 0.0, 0.1])
    seeds, steps = torch.tensor([1, 2, 3, 4]), torch.tensor([9, 9, 9, 9])
    together = truncated_draw(logits, t, k, p, m, seeds, steps)
    for row in range(4):
        alone = truncated_draw(logits[row:row + 1], t[row:row + 1], k[row:row + 1], p[row:row + 1], m[row:row + 1],
                               seeds[row:row + 1], steps[row:row + 1], use_top_k=bool(k[row]),
                               use_top_p=bool(p[row] < 1), use_min_p=bool(m[row] > 0))
        assert alone.item() == together[row].item(), row
    assert together[3] == logits[3].argmax()


def test_the_fused_truncated_draw_draws_what_the_torch_code_draws():
    """On a GPU a truncated draw is the row maxima, one threshold kernel for top-k, top-p and min-p at the
    row's temperature, and the draw kernel dropping what lies below it (run here under the interpreter). It
    draws the torch code's tokens: every rule alone and together, greedy rows beside them, ties at the top,
    -inf logits, several temperatures, seeds and draw positions."""
    from engine.sampler import truncated_draw

    g = torch.Generator().manual_seed(8)
    vocab = 3000
    logits = torch.randn(8, vocab, generator=g) * 3
    logits[2, :50] = float("-inf")
    logits[5, torch.randperm(vocab, generator=g)[:4]] = logits[5].max() + 0.5  # four tied at the top
    t = torch.tensor([1.0, 0.7, 1.3, 0.0, 0.5, 1.0, 2.0, 0.9])
    k = torch.tensor([0, 40, 0, 0, 5, 2, 0, 100])
    p = torch.tensor([0.9, 1.0, 0.8, 0.5, 1.0, 1.0, 0.95, 0.7])
    m = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.2, 0.0, 0.01, 0.1])
    seeds = torch.arange(8) * 7919
    for rules in [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]:
        for step in (0, 5):
            steps = torch.full((8,), step)
            args = (logits, t, k, p, m, seeds, steps, *rules)
            fused = truncated_draw(*args, fused=True)
            assert fused.tolist() == truncated_draw(*args, fused=False).tolist(), (rules, step)
            assert fused[3] == logits[3].argmax(), "a greedy row takes its argmax whatever its top-p"
            if rules[0]:
                assert fused[5].item() in (logits[5] == logits[5].max()).nonzero().flatten().tolist()
    with pytest.raises(ValueError, match="temperature"):
        from kernels.truncation import thresholds
        thresholds(logits, k, p, temperature=t[:3])


def test_each_of_n_samples_is_a_request_with_a_seed_of_its_own():
    p = SamplingParams(n=3, seed=5, temperature=0.7, stop="x")
    samples = [p.sample(j) for j in range(3)]
    assert [s.seed for s in samples] == [5, 6, 7] and all(s.n == 1 for s in samples)
    assert samples[0] == SamplingParams(seed=5, temperature=0.7, stop="x"), "sample 0 is the request with n=1"
    top = SamplingParams(n=4, seed=2**63 - 2)
    assert len({top.sample(j).seed for j in range(4)}) == 4, "seeds near the top of the range stay distinct"
    assert all(SamplingParams(n=2).sample(j).seed is None for j in range(2)), "unseeded samples stay unseeded"
    with pytest.raises(ValueError, match="n must be an integer in"):
        SamplingParams(n=129)
    with pytest.raises(ValueError):
        p.sample(3)


def test_logit_bias_is_added_before_the_draw_and_logprobs_stay_the_models():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    reqs = [Request(rid=str(i), prompt_ids=[1], params=p, seed=i, stop_ids=(), max_len=10) for i, p in
            enumerate([SamplingParams(temperature=0, logit_bias={"1": -100, 2: 1.5}, logprobs=0),
                       SamplingParams(temperature=0)])]
    out = sample(logits, SamplingBatch.build(reqs, 4, "cpu"))
    assert out.tokens.tolist() == [2, 0], "token 1 pushed down, token 2 up; the unbiased row as it was"
    assert torch.allclose(out.logprobs, logits.log_softmax(-1)[[0, 1], [2, 0]])
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1}


@pytest.mark.parametrize("bias", [{"x": 1}, {"-3": 1}, {"5": 101}, {"5": "1"}, [5, 1]])
def test_bad_logit_bias_is_named(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
