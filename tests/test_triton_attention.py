"""The Triton kernels agree with the torch reference (run by the Triton interpreter on a CPU, see
conftest.py; the same kernels compile for the GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import ModelConfig
from kernels.attention import AttentionInputs, create_backend
from kvstore import KVPool

pytest.importorskip("triton")

PAGE = 16


def config(heads=8, kv_heads=2, head_dim=32, window=None) -> ModelConfig:
    return ModelConfig("llama", 100, heads * head_dim, 64, 1, heads, kv_heads, head_dim, 4096, 1e-6, 1e4,
                       sliding_window=window)


def batch(pool: KVPool, prefix_lens: list[int], extend_lens: list[int], gen: torch.Generator) -> AttentionInputs:
    """Requests with random, scattered page tables; their prefixes already hold random K/V."""
    free = torch.randperm(pool.num_pages - 1, generator=gen).add(1).tolist()
    qo, kv_ptr, kv_idx, last, out_pages, out_offsets = [0], [0], [], [], [], []
    for prefix, ext in zip(prefix_lens, extend_lens):
        total = prefix + ext
        n = -(-total // PAGE)
        pages = [free.pop() for _ in range(n)]
        kv_idx += pages
        kv_ptr.append(kv_ptr[-1] + n)
        qo.append(qo[-1] + ext)
        last.append(total - (n - 1) * PAGE)
        for p in range(prefix, total):
            out_pages.append(pages[p // PAGE])
            out_offsets.append(p % PAGE)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    return AttentionInputs(i32(qo), i32(kv_ptr), i32(kv_idx), i32(last), i32(seq), i32(prefix_lens),
                           torch.tensor(out_pages), torch.tensor(out_offsets), max(seq), max(extend_lens))


def run(cfg, prefix_lens, extend_lens, dtype=torch.float32, seed=0, layout="NHD", scales=(1.0, 1.0)):
    """The same step through both backends: (attention output, pool after the step) for each. `scales`: the
    pool's K and V scales; the cached prefix holds the same K and V whatever they are."""
    g = torch.Generator().manual_seed(seed)
    n = sum(extend_lens)
    q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, generator=g).to(dtype)
    k = torch.randn(n, cfg.num_key_value_heads, cfg.head_dim, generator=g).to(dtype)
    v = torch.randn(n, cfg.num_key_value_heads, cfg.head_dim, generator=g).to(dtype)
    outs = {}
    for name in ("torch", "triton"):
        pool = KVPool(96, PAGE, 1, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu", layout)
        pool.set_scales([scales[0]], [scales[1]])
        init = torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(seed + 1))
        init /= torch.tensor(scales).view(2, 1, 1, 1)
        pool.data[:, 1:] = init[:, 1:].to(dtype)  # page 0 stays zero
        x = batch(pool, prefix_lens, extend_lens, torch.Generator().manual_seed(seed + 2))
        step = create_backend(name, pool, cfg).plan(x)
        outs[name] = (step.forward(q, k, v, 0).float(), pool.data.clone())
    return outs


def close(a, b, tol):
    return ((a - b).abs().max() / b.abs().max()).item() < tol


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cfg", [config(), config(heads=4, kv_heads=4, head_dim=64), config(window=40),
                                 config(heads=14, kv_heads=2, head_dim=64)], ids=["gqa4", "mha", "window", "gqa7"])
@pytest.mark.parametrize("regime", ["few-requests", "many-requests"])
def test_decode_matches_reference(cfg, layout, regime, monkeypatch):
    from kernels.attention.triton_backend import TritonBackend

    if regime == "many-requests":  # the launch settings of large batches (TritonBackend.decode_large)
        monkeypatch.setattr(TritonBackend, "target_programs", 1)
    # Contexts from a few tokens (most splits empty) to several hundred (every split busy).
    prefix = [600, 5, 300, 17]
    outs = run(cfg, prefix, [1] * len(prefix), layout=layout)
    assert close(outs["triton"][0], outs["torch"][0], 1e-4)
    assert torch.equal(outs["triton"][1], outs["torch"][1]), "both store the new K/V identically"


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("regime", ["few-requests", "many-requests"])
def test_decode_planned_for_a_far_longer_context_than_the_batch_has(regime, window, monkeypatch):
    """A CUDA graph plans its splits for the longest context it may replay; shorter ones leave splits empty,
    and the merge reads only the splits each request has (the others hold whatever was there before)."""
    from kernels.attention.triton_backend import TritonBackend

    if regime == "many-requests":
        monkeypatch.setattr(TritonBackend, "target_programs", 1)
    cfg = config(window=window)
    real_empty = torch.empty

    def poisoned_empty(*args, **kw):  # the partial outputs start as NaN, not as whatever memory held
        return real_empty(*args, **kw).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    pool = KVPool(96, PAGE, 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu", "NHD")
    pool.data.normal_()
    x = batch(pool, [600, 5, 300, 17], [1, 1, 1, 1], torch.Generator().manual_seed(4))
    q = torch.randn(4, cfg.num_attention_heads, cfg.head_dim)
    ref = create_backend("torch", pool, cfg).plan(x).attend(q, 0)
    step = create_backend("triton", pool, cfg).plan(dataclasses.replace(x, max_seq_len=131072))
    assert step.splits > 8
    assert close(step.attend(q, 0), ref, 1e-4)


@pytest.mark.parametrize("max_splits", [3, 5, 7])
@pytest.mark.parametrize("regime", ["few-requests", "many-requests"])
def test_decode_splits_of_whole_tiles_still_cover_every_context(regime, max_splits, monkeypatch):
    """Splits are rounded up to whole KV tiles (so that tiles start on page boundaries): with few splits for
    long contexts (601 tokens in 3, 5 or 7), the last split is short or empty, and the merge must agree with
    the split kernel on how many there are."""
    from kernels.attention.triton_backend import TritonBackend

    if regime == "many-requests":
        monkeypatch.setattr(TritonBackend, "target_programs", 1)
        monkeypatch.setattr(TritonBackend, "decode_large", dataclasses.replace(TritonBackend.decode_large,
                                                                               max_chunk=64, min_chunk=64))
    monkeypatch.setattr(TritonBackend, "max_splits", max_splits)
    outs = run(config(), [600, 5, 300, 17], [1] * 4)
    assert close(outs["triton"][0], outs["torch"][0], 1e-4)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cfg", [config(), config(window=24)], ids=["gqa4", "window"])
def test_prefill_over_cached_prefix_matches_reference(cfg, layout):
    outs = run(cfg, [0, 37, 16, 70], [40, 9, 1, 66], layout=layout)
    assert close(outs["triton"][0], outs["torch"][0], 1e-4)


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_scales_are_folded_into_scores_and_output(step):
    """A pool stores K / k_scale and V / v_scale (an FP8 pool's scales; a float32 pool here, as the
    interpreter's FP8 cast is not the hardware's): attention reads them back times the scales, in both
    backends, so the output is that of an unscaled pool."""
    prefix, extend = ([600, 5, 300, 17], [1] * 4) if step == "decode" else ([0, 37, 16, 70], [40, 9, 1, 66])
    plain = run(config(), prefix, extend)
    scaled = run(config(), prefix, extend, scales=(8.0, 0.125))
    assert close(scaled["torch"][0], plain["torch"][0], 1e-5)
    assert close(scaled["triton"][0], plain["torch"][0], 1e-4)
    assert torch.equal(scaled["triton"][1], scaled["torch"][1])
    assert not torch.equal(scaled["torch"][1], plain["torch"][1])


def test_half_precision_within_tolerance():
    # fp16 here: the interpreter has no bfloat16 matrix product (numpy has no bfloat16); the GPU benchmark
    # checks the bf16 kernels against the torch backend.
    for prefix, extend in (([100, 20], [1, 1]), ([0, 20], [30, 5])):
        outs = run(config(), prefix, extend, dtype=torch.float16)
        assert close(outs["triton"][0], outs["torch"][0], 1e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_fused_add_rmsnorm_and_silu_mul(dtype, tol):
    from kernels.fused import add_rms_norm, silu_and_mul

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(dtype)
    res = torch.randn(5, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    for r in (None, res):
        out, new_res = add_rms_norm(x, r, w, 1e-6, fused=True)
        ref_out, ref_res = add_rms_norm(x, r, w, 1e-6, fused=False)
        assert torch.equal(new_res, ref_res)
        assert close(out.float(), ref_out.float(), tol)
    h = torch.randn(7, 2 * 1500, generator=g).to(dtype)  # wider than one kernel block
    assert close(silu_and_mul(h, fused=True).float(), silu_and_mul(h, fused=False).float(), tol)


def test_page_copy_kernel_moves_whole_pages_across_pools():
    from kernels.page_copy import copy_pages

    src = KVPool(20, PAGE, 3, 2, 8, torch.float32, "cpu")
    dst = KVPool(30, PAGE, 3, 2, 8, torch.float32, "cpu")
    src.data.copy_(torch.randn(src.data.shape))
    before = dst.data.clone()
    s, d = torch.tensor([3, 17, 5]), torch.tensor([29, 2, 11])
    # Pairs past the real ones are padding (a captured copy of a fixed list length): source page -1, skipped.
    copy_pages(src.data, dst.data, torch.tensor([3, 17, 5, -1, -1]), torch.tensor([29, 2, 11, -1, -1]),
               fused=True)
    for a, b in zip(s.tolist(), d.tolist()):
        assert torch.equal(dst.data[:, b], src.data[:, a])
    rest = [p for p in range(30) if p not in d.tolist()]
    assert torch.equal(dst.data[:, rest], before[:, rest])


# FP8 pools are left to the GPU benchmark: the interpreter's FP8 cast rounds values just below a power of two
# to half of it (-7.97 -> -4), which the hardware does not.
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (4.0, 0.25)], ids=["unscaled", "scaled"])
def test_fused_rope_and_kv_store_match_the_unfused_path(dtype, kv_dtype, layout, scales):
    from engine.model import Rotary

    cfg = config(heads=8, kv_heads=2, head_dim=64)
    g = torch.Generator().manual_seed(3)
    n = 9
    # q and k heads come as a strided view of the fused qkv projection, as in the model.
    qkv = (torch.randn(n, (8 + 2 * 2) * 64, generator=g) * 3).to(dtype)
    qk = qkv[:, : 10 * 64].view(n, 10, 64)
    v = qkv[:, 10 * 64:].view(n, 2, 64)
    positions = torch.randint(0, 4000, (n,), generator=g)
    cos_sin = Rotary(cfg).lookup(positions, dtype)
    outs = {}
    for fused in (False, True):
        pool = KVPool(8, PAGE, 1, 2, 64, kv_dtype, "cpu", layout)
        pool.set_scales([scales[0]], [scales[1]])
        x = batch(pool, [5, 0, 30], [3, 5, 1], torch.Generator().manual_seed(4))
        step = create_backend("torch", pool, cfg).plan(x)
        step.fused = fused
        seen = {}
        step.attend = lambda q, layer_id: seen.setdefault("q", q)  # noqa: B023
        step.forward_rope(qk, v, cos_sin, 8, 0)
        outs[fused] = (seen["q"].float(), pool.data.float())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert close(outs[True][0], outs[False][0], tol)
    # The fused kernel rotates in float32 and rounds once; the reference rounds after each op.
    assert close(outs[True][1], outs[False][1], tol)
    written = outs[False][1].abs().sum(dim=(0, 2, 4, 5)) > 0
    assert torch.equal(written, outs[True][1].abs().sum(dim=(0, 2, 4, 5)) > 0), "the same slots are written"


# Activations in float16 and float32: the interpreter's bfloat16 dot is wrong (the GPU bench runs bf16).
# One row goes to the GEMV, more to the small-batch kernel.
@pytest.mark.parametrize("m, bias, dtype", [(1, False, torch.float16), (2, True, torch.float16),
                                            (5, True, torch.float32), (16, False, torch.float16)])
def test_fp8_weight_kernel_matches_widened_weights(m, bias, dtype):
    from kernels.fp8_linear import fp8_weight_matmul, quantize_per_channel

    g = torch.Generator().manual_seed(m)
    w = torch.randn(72, 200, generator=g) * 0.05  # N and K not multiples of the kernel's blocks
    q, scale = quantize_per_channel(w)
    x = torch.randn(m, 200, generator=g).to(dtype)
    b = torch.randn(72, generator=g).to(dtype) if bias else None
    got = fp8_weight_matmul(x, q, scale, b).float()
    ref = x.float() @ (q.float() * scale[:, None]).t() + (b.float() if bias else 0)
    assert got.shape == (m, 72)
    assert close(got, ref, 1e-2)
    # The quantization itself keeps the product within FP8's rounding of the original weights.
    assert close(got, x.float() @ w.t() + (b.float() if bias else 0), 8e-2)


@pytest.mark.parametrize("dtype, scaled", [(torch.float16, False), (torch.bfloat16, False), (torch.float32, True)])
def test_gemv_matches_a_matmul(dtype, scaled):
    from kernels.gemv import gemv

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(70, 300, generator=g) * 0.05).to(dtype)  # N and K not multiples of the blocks
    x = torch.randn(1, 300, generator=g).to(dtype)
    scale = torch.rand(70, generator=g) + 0.5 if scaled else None
    ref = x.float() @ w.float().t() * (scale if scaled else 1.0)
    got = gemv(x, w, scale).float()
    assert got.shape == (1, 70) and close(got, ref, 1e-2 if dtype != torch.float32 else 1e-5)


def test_gemv_stores_float32_logits_without_rounding_them_to_the_token_dtype():
    """An LM head's one-token GEMV (CausalLM.compute_logits) asks for float32: the sums as they are, closer to
    exact products than the bf16 output rounded up."""
    from kernels.gemv import gemv

    g = torch.Generator().manual_seed(6)
    w = (torch.randn(70, 300, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(1, 300, generator=g).to(torch.bfloat16)
    ref = x.double() @ w.double().t()
    got = gemv(x, w, out_dtype=torch.float32)
    rounded = gemv(x, w)
    assert got.dtype == torch.float32 and got.shape == (1, 70)
    assert (got.double() - ref).abs().max() < 1e-4 < (rounded.double() - ref).abs().max()
    with pytest.raises(ValueError):
        gemv(x, torch.randn(70, 300).to(torch.bfloat16), glu=True, out_dtype=torch.float32)


def test_rotary_lookup_gathers_cos_and_sin_rounded_as_the_float32_tables():
    from engine.model import Rotary

    cfg = config(heads=4, kv_heads=2, head_dim=64)  # positions up to 4096
    rot = Rotary(cfg)
    pos = torch.tensor([0, 7, 4095, 7])
    for dtype in (torch.bfloat16, torch.float32):
        cos, sin = rot.lookup(pos, dtype)
        assert cos.shape == sin.shape == (4, 1, cfg.head_dim) and cos.dtype == dtype
        assert torch.equal(cos, rot.cos[pos].to(dtype)[:, None, :])
        assert torch.equal(sin, rot.sin[pos].to(dtype)[:, None, :])


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("n, k", [(64, 256), (70, 300), (70, 302)])
def test_gemv_of_e4m3_weights_in_every_mode(n, k, ahead):
    """FP8 weights go four to a word when K allows (whole tiles, or partial ones with masks), else byte by byte:
    the same products as the dequantized weights in every mode, the norm and residual folds included, with one
    weight tile in flight or two (the loads past K masked off)."""
    from kernels.fp8_linear import quantize_per_channel
    from kernels.fused import add_rms_norm, silu_and_mul
    from kernels.gemv import gemv

    g = torch.Generator().manual_seed(8)
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g) * 0.05)
    deq = q.float() * scale[:, None]
    x = torch.randn(1, k, generator=g)
    bias = torch.randn(n, generator=g)
    launch = (16, 64, 4, 1, 1, ahead)  # the interpreter's tiles: K = 256 is four of them
    if k % 4 and ahead > 1:  # read byte by byte: no tiles of words to load ahead
        with pytest.raises(ValueError):
            gemv(x, q, scale, launch=launch)
        return
    with pytest.raises(ValueError):
        gemv(x, q, scale, launch=(16, 64, 4, 1, 1, 3))
    assert close(gemv(x, q, scale, bias, launch=launch), x @ deq.t() + bias, 1e-5)
    assert close(gemv(x, q, scale, bias, glu=True, launch=launch), silu_and_mul(x @ deq.t() + bias, fused=False),
                 1e-5)
    norm_w = torch.rand(k, generator=g) + 0.5
    normed, _ = add_rms_norm(x, None, norm_w, 1e-6, fused=False)
    assert close(gemv(x, q, scale, norm=(norm_w, 1e-6), launch=launch), normed @ deq.t(), 1e-5)
    r = torch.randn(1, n, generator=g)
    expect = r + x @ deq.t()
    assert gemv(x, q, scale, residual=r, launch=launch) is r and close(r, expect, 1e-5)


@pytest.mark.parametrize("n, k, split", [(64, 512, 2), (64, 512, 4), (70, 300, 3), (48, 256, 8)])
def test_gemv_of_e4m3_weights_split_over_k(n, k, split):
    """K split among programs: the last program of each row block adds the partials (and the folded norm's
    partial sums of squares) in split order, the same products in every mode, equal on every call, and the
    counters are back at zero after each launch. (64, 512, 2/4): whole slices; (70, 300, 3): partial slices
    and rows; (48, 256, 8): more splits than whole tiles, so the last programs have nothing to add."""
    from kernels.fp8_linear import quantize_per_channel
    from kernels.fused import add_rms_norm, silu_and_mul
    from kernels.gemv import gemv

    g = torch.Generator().manual_seed(9)
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g) * 0.05)
    deq = q.float() * scale[:, None]
    counters = torch.zeros(8, dtype=torch.int32)
    launch = (16, 64, 4, 1, split)
    x = torch.randn(1, k, generator=g)
    bias = torch.randn(n, generator=g)
    first = gemv(x, q, scale, bias, launch=launch, counters=counters)
    assert close(first, x @ deq.t() + bias, 1e-5) and not counters.any()
    assert torch.equal(gemv(x, q, scale, bias, launch=launch, counters=counters), first)
    got = gemv(x, q, scale, glu=True, launch=launch, counters=counters)
    assert close(got, silu_and_mul(x @ deq.t(), fused=False), 1e-5) and not counters.any()
    norm_w = torch.rand(k, generator=g) + 0.5
    normed, _ = add_rms_norm(x, None, norm_w, 1e-6, fused=False)
    got = gemv(x, q, scale, norm=(norm_w, 1e-6), launch=launch, counters=counters)
    assert close(got, normed @ deq.t(), 1e-5) and not counters.any()
    r = torch.randn(1, n, generator=g)
    expect = r + x @ deq.t()
    assert gemv(x, q, scale, residual=r, launch=launch) is r and close(r, expect, 1e-5)  # its own counters
    with pytest.raises(ValueError):
        gemv(x, q, scale, launch=launch, counters=torch.zeros(2, dtype=torch.int32))  # too few for the blocks
    with pytest.raises(ValueError):
        gemv(x, deq, launch=launch)  # only e4m3 weights split K


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemv_with_glu_is_gate_up_proj_then_the_separate_activation(dtype):
    """glu=True: each program takes matching gate and up rows and applies SiLU-and-mul to them, rounded as the
    separate projection and activation kernels round: the same numbers as the two launches, to the bit, with a
    partial last block (35 outputs in programs of eight) and the folded norm."""
    from kernels.fused import silu_and_mul
    from kernels.gemv import gemv

    g = torch.Generator().manual_seed(6)
    w = (torch.randn(70, 300, generator=g) * 0.05).to(dtype)  # gate rows, then up rows
    x = torch.randn(1, 300, generator=g).to(dtype)
    bias = torch.randn(70, generator=g).to(dtype)
    got = gemv(x, w, bias=bias, glu=True)
    assert got.shape == (1, 35) and torch.equal(got, silu_and_mul(gemv(x, w, bias=bias), fused=True))
    norm = ((torch.rand(300, generator=g) + 0.5).to(dtype), 1e-6)
    assert torch.equal(gemv(x, w, glu=True, norm=norm), silu_and_mul(gemv(x, w, norm=norm), fused=True))
    with pytest.raises(ValueError):
        gemv(x, w[:69], glu=True)  # an odd number of rows has no halves
    with pytest.raises(ValueError):
        gemv(x, w, glu=True, residual=torch.zeros(1, 35, dtype=dtype))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 32), (3, 1, 8)])  # (3, 1, 8): a partial last block
@pytest.mark.parametrize("weights", ["float", "fp8", "fp8-split"])
def test_gemv_with_rope_is_qkv_proj_then_rope_store(weights, heads, kv_heads, dim, layout):
    """rope=: the projection's head rows pair d with d + D/2, and the finished pairs are rotated and stored as
    rope_store does after the separate projection: q, and k and v in the token's pool slot, to the bit."""
    from engine.model import Rotary
    from kernels.fp8_linear import quantize_per_channel
    from kernels.gemv import gemv
    from kernels.rope import RopeTarget, rope_store

    g = torch.Generator().manual_seed(11)
    n, k = (heads + 2 * kv_heads) * dim, 64
    w = torch.randn(n, k, generator=g) * 0.1
    scale, launch = None, None
    if weights != "float":
        w, scale = quantize_per_channel(w)
        launch = (16, 64, 4, 1, 2) if weights == "fp8-split" else None
    else:
        w = w.half()
    x = torch.randn(1, k, generator=g).to(torch.float16 if weights == "float" else torch.float32)
    bias = torch.randn(n, generator=g).to(x.dtype)
    cfg = config(heads=heads, kv_heads=kv_heads, head_dim=dim)
    cos, sin = Rotary(cfg).lookup(torch.tensor([1234]), x.dtype)
    pages, slots = torch.tensor([5]), torch.tensor([7])
    results = []
    kv_scales = (2.0, 0.25)  # the pool's K and V scales: both paths store k / 2 and v * 4
    for fused in (False, True):
        pool = KVPool(8, PAGE, 1, kv_heads, dim, x.dtype, "cpu", layout)
        kv = pool.tokens_view(0)
        counters = torch.zeros(n, dtype=torch.int32)
        if fused:
            q = gemv(x, w, scale, bias, launch=launch, counters=counters,
                     rope=RopeTarget(cos[0, 0], sin[0, 0], kv, pages, slots, heads, *kv_scales))
        else:
            qkv = gemv(x, w, scale, bias, launch=launch, counters=counters)
            qk = qkv[:, : (heads + kv_heads) * dim].view(1, heads + kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim:].view(1, kv_heads, dim)
            q = rope_store(qk, v, (cos, sin), kv, pages, slots, heads, *kv_scales)
        results.append((q, pool.data.clone()))
        assert not counters.any()
    (q_ref, pool_ref), (q_got, pool_got) = results
    assert q_got.shape == (1, heads, dim) and torch.equal(q_got, q_ref)
    assert pool_ref.abs().sum() > 0 and torch.equal(pool_got, pool_ref)
    with pytest.raises(ValueError):
        gemv(x, w[:-2], scale, rope=RopeTarget(cos[0, 0], sin[0, 0], kv, pages, slots, heads))  # rows != heads


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemv_folds_the_norm_before_and_the_residual_add_after(dtype):
    """norm=: the projection of rmsnorm(stream); residual=: stream += projection, in place, rounded as the
    separate add + rmsnorm kernel rounds."""
    from kernels.fused import add_rms_norm
    from kernels.gemv import gemv

    g = torch.Generator().manual_seed(7)
    w_in = (torch.randn(70, 300, generator=g) * 0.05).to(dtype)
    w_out = (torch.randn(300, 70, generator=g) * 0.05).to(dtype)
    norm_w = (torch.rand(300, generator=g) + 0.5).to(dtype)
    stream = torch.randn(1, 300, generator=g).to(dtype)
    tol = 1e-2 if dtype != torch.float32 else 1e-5

    h, _ = add_rms_norm(stream, None, norm_w, 1e-6, fused=False)
    got = gemv(stream, w_in, norm=(norm_w, 1e-6))
    assert close(got.float(), (h.float() @ w_in.float().t()), tol)

    a = torch.randn(1, 70, generator=g).to(dtype)
    expect = gemv(a, w_out) + stream  # the separate projection, then the separate add
    r = stream.clone()
    assert gemv(a, w_out, residual=r) is r
    assert torch.equal(r, expect)
    with pytest.raises(ValueError):
        gemv(a, w_out, residual=torch.zeros(1, 71, dtype=dtype))
    with pytest.raises(ValueError):
        gemv(torch.randn(1, 140, generator=g).to(dtype), w_in, norm=(norm_w, 1e-6))  # x is not [1, K]


@pytest.mark.parametrize("weights", ["float32", "e4m3", "e4m3 split"])
def test_gemv_norm_reads_the_sum_of_squares_the_residual_add_left(weights):
    """squares=: a GEMV that adds into the stream leaves one partial sum of squares per program, and the next
    GEMV that folds a norm takes its scale from them: the same numbers as gathering it from the token. A
    launch with more programs than the buffer holds leaves none, and the norm gathers the sum itself."""
    from kernels.fp8_linear import quantize_per_channel
    from kernels.fused import add_rms_norm
    from kernels.gemv import TokenSquares, gemv

    g = torch.Generator().manual_seed(11)
    w_in = torch.randn(70, 300, generator=g) * 0.05
    w_out = torch.randn(300, 72, generator=g) * 0.05
    norm_w = torch.rand(300, generator=g) + 0.5
    launch, scale_in, scale_out = None, None, None
    if weights != "float32":
        w_in, scale_in = quantize_per_channel(w_in)
        w_out, scale_out = quantize_per_channel(w_out)
        launch = (16, 64, 4, 1, 2 if weights == "e4m3 split" else 1)
    stream = torch.randn(1, 300, generator=g)
    a = torch.randn(1, 72, generator=g)

    squares = TokenSquares.new(torch.device("cpu"))
    r = stream.clone()
    gemv(a, w_out, scale_out, residual=r, squares=squares, launch=launch)
    assert squares.count == -(-300 // 16)  # the interpreter's programs of 16 rows
    assert close(squares.buf[: squares.count].sum(), (r * r).sum(), 1e-5)
    gathered = gemv(r, w_in, scale_in, norm=(norm_w, 1e-6), launch=launch)
    assert close(gemv(r, w_in, scale_in, norm=(norm_w, 1e-6), squares=squares, launch=launch), gathered, 1e-5)
    normed, _ = add_rms_norm(r, None, norm_w, 1e-6, fused=False)
    assert close(gathered, gemv(normed, w_in, scale_in, launch=launch), 1e-5)

    # With next_norm, the residual add also leaves the stream times that norm's weight, and the GEMV that folds
    # the same norm reads it in place of the stream: the same numbers again. A norm of another weight does not.
    primed = TokenSquares.new(torch.device("cpu"), width=300)
    r2 = stream.clone()
    gemv(a, w_out, scale_out, residual=r2, squares=primed, next_norm=norm_w, launch=launch)
    assert torch.equal(r2, r) and primed.token_norm is norm_w
    assert torch.equal(primed.token, r2[0].float() * norm_w)
    assert close(gemv(r2, w_in, scale_in, norm=(norm_w, 1e-6), squares=primed, launch=launch), gathered, 1e-5)
    garbage = torch.full_like(r2, 1e3)  # the stream argument is not read when the token is
    assert close(gemv(garbage, w_in, scale_in, norm=(norm_w, 1e-6), squares=primed, launch=launch), gathered, 1e-5)
    other_w = norm_w.clone()
    assert close(gemv(r2, w_in, scale_in, norm=(other_w, 1e-6), squares=primed, launch=launch), gathered, 1e-5)
    with pytest.raises(ValueError):
        gemv(a, w_out, scale_out, residual=r2, squares=primed, next_norm=norm_w[:10], launch=launch)

    # summed=True: the add's last program adds the partial sums into one, which the reader takes its scale
    # from; the arrivals counter is back at zero for the next launch, as a graph replay needs.
    one = TokenSquares.new(torch.device("cpu"), width=300, summed=True)
    for _ in range(2):
        r3 = stream.clone()
        gemv(a, w_out, scale_out, residual=r3, squares=one, next_norm=norm_w, launch=launch)
        assert torch.equal(r3, r) and one.count == 1 and int(one.arrivals) == 0
        assert close(one.buf[0], (r3 * r3).sum(), 1e-5)
        assert close(gemv(r3, w_in, scale_in, norm=(norm_w, 1e-6), squares=one, launch=launch), gathered, 1e-5)
    with pytest.raises(ValueError):
        gemv(a, w_out, scale_out, residual=r3, squares=TokenSquares(torch.zeros(64), summed=True), launch=launch)

    few = TokenSquares.new(torch.device("cpu"), size=4)
    gemv(a, w_out, scale_out, residual=r.clone(), squares=few, launch=launch)
    assert few.count == 0
    assert close(gemv(r, w_in, scale_in, norm=(norm_w, 1e-6), squares=few, launch=launch), gathered, 1e-5)
    with pytest.raises(ValueError):
        gemv(a, w_out, scale_out, residual=r, squares=TokenSquares(torch.zeros(64, dtype=torch.float64)))


def test_every_landed_gemv_launch_builds_for_sm90_without_spilling_tiles():
    """bench.gemv_build compiles each launch config() picks for the 8B and 0.5B projections, bf16 and FP8, for
    an H200 without one. A few registers may be parked on the stack around the K loop (the split-K FP8 qkv
    parks two), but no tile: a spilled accumulator reads as kilobytes. Each launch fits at least two programs
    per SM (the GEMV hides its load latency with several programs in flight)."""
    import os
    import subprocess
    import sys

    from bench import gemv_build

    # A process of its own: this module's kernels run in the interpreter, which cannot compile them.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.gemv_build"], env=env, capture_output=True, text=True,
                         timeout=300, check=True, cwd=os.path.dirname(os.path.dirname(gemv_build.__file__))).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    rows = [[c.strip() for c in r] for r in rows[1:]]  # past the header
    assert len(rows) == 2 * len(gemv_build.SHAPES)
    for name, weights, launch, regs, stack, shared, programs in rows:
        assert 0 < int(regs) <= 255 and int(stack) <= 64 and int(programs) >= 2, (name, weights, launch, stack)
