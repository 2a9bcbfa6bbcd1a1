"""FP8 KV scales: bounds from the weights that no token exceeds, and a pool that keeps K and V beyond e4m3's
range instead of saturating them."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_clean, build_hf_model, make_tokenizer_files, rel_err
from engine import Engine, SamplingParams
from engine.kv_scales import kv_bounds, scale_for
from engine.protocol import KVLayout
from kvstore import KVPool

PROMPTS = [[5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 77, 12] * 3, list(range(10, 90)), [400, 3]]


def first_logits(engine: Engine) -> torch.Tensor:
    """Each prompt's first-token logits: prefill attention reads every K/V back from the pool."""
    seen = []
    inner = engine.runner.sample

    def sample(logits, reqs):
        seen.append(logits.float().clone())
        return inner(logits, reqs)

    engine.runner.sample = sample
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=1), rid=str(i))
        while engine.has_work():
            engine.step()
    assert_pool_clean(engine)
    return torch.cat(seen)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # plain; q/k/v biases; per-head k norms
def test_no_stored_key_or_value_exceeds_its_bound(tiny_models, family):
    path, _ = tiny_models[family]
    engine = Engine(model_path=path, max_total_tokens=1024, disable_radix_cache=True)
    k_bounds, v_bounds = kv_bounds(engine.model)
    first_logits(engine)
    # A float32 pool stores K (after rope) and V as computed; the freed pages still hold them.
    kv = engine.pool.data.abs()
    for layer in range(engine.pool.num_layers):
        k_max, v_max = kv[layer, :, 0].max().item(), kv[layer, :, 1].max().item()
        assert 0 < k_max <= k_bounds[layer] and 0 < v_max <= v_bounds[layer]
        # Worst cases, but not so loose that typical values fall into e4m3's subnormals.
        assert k_bounds[layer] < 32 * k_max and v_bounds[layer] < 32 * v_max


def test_scales_are_the_powers_of_two_that_fit_the_bound_in_range():
    e4m3 = torch.float8_e4m3fn
    assert scale_for(448.0 / 1.04, e4m3) == 1.0
    assert scale_for(448.0, e4m3) == 2.0  # the margin for bf16 rounding
    assert scale_for(1500.0, e4m3) == 4.0
    assert scale_for(10.0, e4m3) == 2.0 ** -5
    assert scale_for(1500.0, torch.bfloat16) == 1.0
    assert scale_for(0.0, e4m3) == 1.0
    pool = KVPool(4, 16, 2, 2, 8, e4m3, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        pool.set_scales([1.0, 3.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 layers"):
        pool.set_scales([1.0], [1.0])


@pytest.fixture(scope="module")
def qwen2_with_large_biases(tmp_path_factory):
    """The tiny Qwen2 with K biases of 1,500 on a few channels of every KV head and a V bias of 900: values
    three times e4m3's range, as real Qwen2 checkpoints have on some K channels."""
    model = build_hf_model("qwen2")
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            dim = attn.head_dim
            for h in range(model.config.num_key_value_heads):
                attn.k_proj.bias[h * dim + 1] += 1500.0
                attn.k_proj.bias[h * dim + dim // 2 + 3] -= 1200.0
            attn.v_proj.bias[5] += 900.0
    path = str(tmp_path_factory.mktemp("qwen2-bias"))
    model.save_pretrained(path)
    make_tokenizer_files(path)
    return path


def stored(engine: Engine) -> torch.Tensor:
    """The pool's K and V as attention reads them: stored values times their layer's scales."""
    pool = engine.pool
    scales = torch.tensor([pool.k_scale, pool.v_scale]).t().reshape(-1, 1, 2, 1, 1, 1)
    return pool.data.float() * scales


def test_fp8_pool_keeps_keys_and_values_beyond_the_format_range(qwen2_with_large_biases):
    """What the pool holds, not the logits: in this random model a K channel of 1,500 makes attention so
    sharp that e4m3's rounding of it (up to 6 %, about 90) reorders the scores whatever the scale."""
    path = qwen2_with_large_biases
    ref = Engine(model_path=path, max_total_tokens=1024)
    scaled = Engine(model_path=path, max_total_tokens=1024, kv_cache_dtype="fp8_e4m3")
    assert min(scaled.pool.k_scale) >= 4.0 and min(scaled.pool.v_scale) >= 2.0
    unit = Engine(model_path=path, max_total_tokens=1024, kv_cache_dtype="fp8_e4m3")
    unit.pool.set_scales([1.0] * unit.pool.num_layers, [1.0] * unit.pool.num_layers)
    for e in (ref, scaled, unit):
        first_logits(e)
    # The same requests in the same order: each page holds the same tokens in all three pools.
    assert rel_err(stored(scaled), stored(ref)) < 2.0 ** -4, "within e4m3's rounding"
    assert rel_err(stored(unit), stored(ref)) > 0.5, "at scale 1.0, 1,500 saturates at 448"


def test_pools_with_other_scales_do_not_exchange_pages():
    a = KVPool(4, 16, 2, 2, 8, torch.float8_e4m3fn, "cpu")
    b = KVPool(4, 16, 2, 2, 8, torch.float8_e4m3fn, "cpu")
    assert KVLayout.of(a) == KVLayout.of(b) and KVLayout.of(a).k_scale == ()
    b.set_scales([1.0, 2.0], [1.0, 1.0])
    assert KVLayout.of(a) != KVLayout.of(b)
    a.set_scales([1.0, 2.0], [1.0, 1.0])
    assert KVLayout.of(a) == KVLayout.of(b)
