"""Our model implementation computes what transformers computes, on random weights of each real family."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, assert_pool_clean, rel_err
from engine import Engine, SamplingParams

PROMPTS = [
    [5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 77, 12],
    [400, 3],
    list(range(10, 80)),  # long enough to cross Mistral's 24-token sliding window and several pages
    [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262, 263, 264, 265, 266, 267, 268],
]
DECODE_STEPS = 20


def record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner's sampling so every logits row it sees is kept per request."""
    seen: dict[str, list[torch.Tensor]] = {}
    inner = engine.runner.sample

    def sample(logits, reqs):
        for row, req in zip(logits, reqs):
            seen.setdefault(req.rid, []).append(row.clone())
        return inner(logits, reqs)

    engine.runner.sample = sample
    return seen


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def run(engine: Engine, prompts, steps=DECODE_STEPS):
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    return reqs


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_for_batched_prefill_and_decode(family, tiny_models):
    path, hf = tiny_models[family]
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=16)
    seen = record_logits(engine)
    reqs = run(engine, PROMPTS)
    for req in reqs:
        ours = torch.stack(seen[req.rid])  # prefill's last position, then one row per decode step
        assert ours.shape[0] == DECODE_STEPS
        full = req.prompt_ids + req.output_ids
        ref = hf_logits(hf, full)[len(req.prompt_ids) - 1: len(full) - 1]
        assert rel_err(ours, ref) < 1e-4, f"{family}: prompt of {req.prompt_len} tokens"
    assert_pool_clean(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_over_a_cached_prefix_matches_transformers(family, tiny_models):
    path, hf = tiny_models[family]
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=8)
    shared = list(range(100, 148))  # six full pages
    run(engine, [shared + [7, 8, 9]], steps=2)
    seen = record_logits(engine)
    second = shared + [20, 21, 22, 23, 24]
    (req,) = run(engine, [second], steps=5)
    assert req.cached_tokens == len(shared), "the shared pages must come from the cache"
    full = req.prompt_ids + req.output_ids
    ref = hf_logits(hf, full)[len(second) - 1: len(full) - 1]
    assert rel_err(torch.stack(seen[req.rid]), ref) < 1e-4
    assert_pool_clean(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers_generate(family, tiny_models):
    path, hf = tiny_models[family]
    engine = Engine(model_path=path, max_total_tokens=4096, chunked_prefill_size=32)
    reqs = run(engine, PROMPTS)
    for req in reqs:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([req.prompt_ids]), max_new_tokens=DECODE_STEPS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, req.prompt_len:].tolist()
        assert req.output_ids == ref
    assert_pool_clean(engine)


@pytest.mark.parametrize("squares,token,summed", [("1", "1", "0"), ("1", "0", "0"), ("0", "1", "0"), ("1", "1", "1")],
                         ids=["token", "squares", "gathered", "summed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_token_steps_with_norms_folded_into_the_projections_match_transformers(family, squares, token, summed,
                                                                                   tiny_models, monkeypatch):
    """The GPU's batch-1 path (engine.model.DecoderLayer.forward_folded: no norm kernels, residual adds in
    the projections' GEMV), run here by the Triton interpreter; each norm's scale from the sums of squares
    o_proj and down_proj leave (PDSERVE_NORM_SQUARES=1, the default) or gathered by its own GEMV, and its
    weight applied by the residual add before (PDSERVE_NORM_TOKEN=1, the default) or in the K loop; the
    partial sums added into one by the add's last program (PDSERVE_NORM_SQUARES_SUMMED=1) or by every reader."""
    pytest.importorskip("triton")
    from engine.model import CausalLM

    monkeypatch.setattr(CausalLM, "fold_norms", True)
    monkeypatch.setenv("PDSERVE_NORM_SQUARES", squares)
    monkeypatch.setenv("PDSERVE_NORM_TOKEN", token)
    monkeypatch.setenv("PDSERVE_NORM_SQUARES_SUMMED", summed)
    path, hf = tiny_models[family]
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=16)
    seen = record_logits(engine)
    (req,) = run(engine, [PROMPTS[0]], steps=6)
    full = req.prompt_ids + req.output_ids
    ref = hf_logits(hf, full)[len(req.prompt_ids) - 1: len(full) - 1]
    assert rel_err(torch.stack(seen[req.rid]), ref) < 1e-4
    assert_pool_clean(engine)


def test_a_float32_token_scaled_by_the_residual_add_gives_the_k_loops_numbers_exactly(tiny_models, monkeypatch):
    """PDSERVE_NORM_TOKEN moves the norm weight's multiply from the folded GEMV's K loop to the residual add
    before it: in float32 the same products, so the same logits to the bit, step after step."""
    pytest.importorskip("triton")
    import kernels.gemv as gemv_module
    from engine.model import CausalLM

    monkeypatch.setattr(CausalLM, "fold_norms", True)
    path, _ = tiny_models[FAMILIES[0]]
    reads = []
    reads_token = gemv_module._reads_token
    monkeypatch.setattr(gemv_module, "_reads_token", lambda *a: reads.append(reads_token(*a)) or reads[-1])
    runs = []
    for token in ("1", "0"):
        monkeypatch.setenv("PDSERVE_NORM_TOKEN", token)
        engine = Engine(model_path=path, max_total_tokens=4096, page_size=16)
        assert engine.model.embed_tokens.weight.dtype == torch.float32
        seen = record_logits(engine)
        (req,) = run(engine, [PROMPTS[0]], steps=4)
        runs.append(torch.stack(seen[req.rid]))
        # Every folded norm but the first layer's reads the token when there is one, none when there is not.
        layers = engine.model.config.num_hidden_layers
        assert reads.count(True) == (3 * (2 * layers - 1) if token == "1" else 0)  # 3 one-token steps
        reads.clear()
    assert torch.equal(runs[0], runs[1])


def test_one_token_steps_fold_the_norms_by_default_only_in_narrow_models_with_16_bit_weights(tiny_llama,
                                                                                            monkeypatch):
    """PDSERVE_FOLD_NORMS unset: a GPU's one-token step folds the norms where the model is at most
    CausalLM.fold_max_width wide and its projections are not FP8; the variable forces either way. Never on
    a device without the Triton GEMV, nor for a batch."""
    import engine.model as model_module
    from kernels.fp8_linear import quantize_model

    model = Engine(model_path=tiny_llama[0], max_total_tokens=256, page_size=16).model
    token = torch.zeros(1, model.config.hidden_size)
    monkeypatch.delenv("PDSERVE_FOLD_NORMS", raising=False)
    assert not model.folds(token)  # the CPU has no Triton GEMV
    monkeypatch.setattr(model_module, "gemv_available", lambda x: True)
    assert model.config.hidden_size <= model.fold_max_width and model.folds(token)
    assert not model.folds(torch.zeros(2, model.config.hidden_size))
    monkeypatch.setenv("PDSERVE_FOLD_NORMS", "0")
    assert not model.folds(token)
    monkeypatch.setattr(model, "fold_max_width", model.config.hidden_size - 1)
    monkeypatch.setenv("PDSERVE_FOLD_NORMS", "1")
    assert model.folds(token)
    monkeypatch.delenv("PDSERVE_FOLD_NORMS")
    assert not model.folds(token)  # wider than the limit
    monkeypatch.setattr(model, "fold_max_width", model.config.hidden_size)
    quantize_model(model)
    assert not model.folds(token)  # FP8 projections


@pytest.mark.parametrize("fold", [False, True], ids=["norms", "norms-folded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_token_steps_with_rope_in_the_qkv_projection_match_transformers(family, fold, tiny_models,
                                                                            monkeypatch):
    """PDSERVE_FUSE_ROPE's path (kernels/gemv.py, rope=: rope and the KV store in the qkv GEMV), run here by
    the Triton interpreter; families with q/k norms keep the separate rope."""
    pytest.importorskip("triton")
    from engine.model import CausalLM

    monkeypatch.setattr(CausalLM, "fuse_rope", True)
    monkeypatch.setattr(CausalLM, "fold_norms", fold)
    path, hf = tiny_models[family]
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=16)
    seen = record_logits(engine)
    (req,) = run(engine, [PROMPTS[0]], steps=6)
    full = req.prompt_ids + req.output_ids
    ref = hf_logits(hf, full)[len(req.prompt_ids) - 1: len(full) - 1]
    assert rel_err(torch.stack(seen[req.rid]), ref) < 1e-4
    assert_pool_clean(engine)


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama, tmp_path):
    import os

    from conftest import make_tokenizer_files

    path, hf = tiny_llama
    hf.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    make_tokenizer_files(str(tmp_path))
    a = Engine(model_path=path, max_total_tokens=1024)
    b = Engine(model_path=str(tmp_path), max_total_tokens=1024)
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
