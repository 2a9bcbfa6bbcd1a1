"""The Triton kernels agree with the torch reference (run by the Triton interpreter on a CPU, see
conftest.py; the same kernels compile for the GPU)."""

from __future__ import annotations

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


def run(cfg, prefix_lens, extend_lens, dtype=torch.float32, seed=0):
    """The same step through both backends: (attention output, pool after the step) for each."""
    g = torch.Generator().manual_seed(seed)
    n = sum(extend_lens)
    q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, generator=g).to(dtype)
    k = torch.randn(n, cfg.num_key_value_heads, cfg.head_dim, generator=g).to(dtype)
    v = torch.randn(n, cfg.num_key_value_heads, cfg.head_dim, generator=g).to(dtype)
    outs = {}
    for name in ("torch", "triton"):
        pool = KVPool(96, PAGE, 1, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu")
        init = torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(seed + 1))
        pool.data[:, 1:] = init[:, 1:].to(dtype)  # page 0 stays zero
        x = batch(pool, prefix_lens, extend_lens, torch.Generator().manual_seed(seed + 2))
        step = create_backend(name, pool, cfg).plan(x)
        outs[name] = (step.forward(q, k, v, 0).float(), pool.data.clone())
    return outs


def close(a, b, tol):
    return ((a - b).abs().max() / b.abs().max()).item() < tol


@pytest.mark.parametrize("cfg", [config(), config(heads=4, kv_heads=4, head_dim=64), config(window=40)],
                         ids=["gqa4", "mha", "window"])
def test_decode_matches_reference(cfg):
    # Long enough contexts to use several KV splits (each split is at least 256 tokens).
    prefix = [600, 5, 300, 17]
    outs = run(cfg, prefix, [1] * len(prefix))
    assert close(outs["triton"][0], outs["torch"][0], 1e-4)
    assert torch.equal(outs["triton"][1], outs["torch"][1]), "both store the new K/V identically"


@pytest.mark.parametrize("cfg", [config(), config(window=24)], ids=["gqa4", "window"])
def test_prefill_over_cached_prefix_matches_reference(cfg):
    outs = run(cfg, [0, 37, 16, 70], [40, 9, 1, 66])
    assert close(outs["triton"][0], outs["torch"][0], 1e-4)


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
    copy_pages(src.data, dst.data, s, d, fused=True)
    for a, b in zip(s.tolist(), d.tolist()):
        assert torch.equal(dst.data[:, b], src.data[:, a])
    rest = [p for p in range(30) if p not in d.tolist()]
    assert torch.equal(dst.data[:, rest], before[:, rest])
