"""The worker core: continuous batching, retraction, prefix reuse, bad input, and the offline API."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from conftest import assert_pool_clean
from engine import LLM, Engine, GenerateError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n):
    return [[(7 * i + j * 13) % 400 + 5 for j in range(20 + 3 * i)] for i in range(n)]


def drain(engine):
    while engine.has_work():
        engine.step()


def test_small_pool_retracts_and_still_matches_large_pool(tiny_llama, caplog):
    path, _ = tiny_llama
    big = Engine(model_path=path, max_total_tokens=8192)
    small = Engine(model_path=path, max_total_tokens=160, page_size=8, chunked_prefill_size=48)
    ps = prompts(8)  # together they need ~600 tokens of KV; the small pool holds 160
    ref = [big.add_request(p, GREEDY) for p in ps]
    drain(big)
    with caplog.at_level(logging.WARNING):
        got = [small.add_request(p, GREEDY) for p in ps]
        drain(small)
    assert small.scheduler.num_retracted > 0
    assert "KV cache pool is full. Retract requests." in caplog.text
    for a, b in zip(ref, got):
        assert b.finish_reason == "length" and len(b.output_ids) == 24
        assert a.output_ids == b.output_ids
    assert_pool_clean(big)
    assert_pool_clean(small)


def test_many_requests_share_steps_and_respect_max_running(tiny_llama):
    path, _ = tiny_llama
    engine = Engine(model_path=path, max_total_tokens=4096, max_running_requests=3)
    reqs = [engine.add_request(p, GREEDY) for p in prompts(7)]
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3
    assert all(r.finish_reason == "length" for r in reqs)
    assert_pool_clean(engine)


def test_shared_prefix_is_reused_from_cache_with_identical_output(tiny_llama):
    path, _ = tiny_llama
    prefix = [(i * 37) % 450 + 3 for i in range(200)]
    engine = Engine(model_path=path, max_total_tokens=4096)
    no_cache = Engine(model_path=path, max_total_tokens=4096, disable_radix_cache=True)
    first = engine.add_request(prefix + [11, 12, 13], GREEDY)
    drain(engine)
    hits_before = engine.stats()["prefix_hit_tokens"]
    second = engine.add_request(prefix + [21, 22], GREEDY)
    drain(engine)
    assert second.cached_tokens == 192  # 12 whole pages of 16 of the shared 200 tokens
    assert engine.stats()["prefix_hit_tokens"] - hits_before >= 192
    ref = no_cache.add_request(prefix + [21, 22], GREEDY)
    drain(no_cache)
    assert second.output_ids == ref.output_ids
    assert first.output_ids != second.output_ids or first.prompt_ids != second.prompt_ids
    assert_pool_clean(engine)
    assert_pool_clean(no_cache)


def test_requests_arriving_together_compute_a_shared_prompt_once(tiny_llama):
    """n samples of one prompt, or a burst behind one long system prompt, arrive in the same step: the first
    computes the shared pages; the others wait until those are launched and take them from the cache. A request
    that shares nothing is not held back, and every output equals a run without the cache."""
    path, _ = tiny_llama
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=16, chunked_prefill_size=512)
    no_cache = Engine(model_path=path, max_total_tokens=4096, disable_radix_cache=True)
    shared = [(i * 37) % 450 + 3 for i in range(150)]
    ps = [shared + [11], shared + [11], [5, 6, 7] + shared, shared + [12, 13], shared[:20] + [9] * 30]
    got = [engine.add_request(p, GREEDY) for p in ps]
    engine.step()
    assert [r in engine.scheduler.running for r in got] == [True, False, True, False, True]
    drain(engine)
    # 144: the whole pages of the 150 shared tokens. The last request's 20 shared tokens are too few to wait for.
    assert [r.cached_tokens for r in got] == [0, 144, 0, 144, 0]
    ref = [no_cache.add_request(p, GREEDY) for p in ps]
    drain(no_cache)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert_pool_clean(engine)


def test_abort_frees_the_request_pages(tiny_llama):
    path, _ = tiny_llama
    engine = Engine(model_path=path, max_total_tokens=1024, disable_radix_cache=True)
    free0 = engine.allocator.num_free
    a = engine.add_request(prompts(1)[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    b = engine.add_request(prompts(2)[1], GREEDY)
    engine.step()
    engine.step()
    assert engine.allocator.num_free < free0
    assert engine.abort(a.rid)
    assert a.finish_reason == "abort"
    drain(engine)
    assert b.finish_reason == "length"
    assert engine.allocator.num_free == free0
    assert_pool_clean(engine)


@pytest.mark.parametrize("bad, needle", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"params": {"max_tokens": 0}}, "max_tokens"),
    ({"prompt_token_ids": list(range(5, 505)) * 2}, "context length is 512"),
    ({"params": {"temperature": -0.5}}, "temperature"),
    ({"params": {"temprature": 0.5}}, "unknown sampling parameter(s): 'temprature'"),
    ({"params": {"top_p": 0}}, "top_p"),
    ({"prompt_token_ids": [5, 10_000]}, "prompt token ids"),
])
def test_bad_input_is_named_and_the_rest_of_the_batch_finishes(tiny_llama, bad, needle):
    path, _ = tiny_llama
    llm = LLM(path, max_total_tokens=4096)
    good = {"prompt_token_ids": [5, 6, 7, 8]}
    bad_prompt = {"prompt_token_ids": bad["prompt_token_ids"]} if "prompt_token_ids" in bad else bad.get(
        "prompt", good)
    params = [GREEDY, bad.get("params", GREEDY), GREEDY]
    with pytest.raises(GenerateError) as err:
        llm.generate([good, bad_prompt, "hello world"], params)
    assert list(err.value.errors) == [1]
    assert needle in err.value.errors[1] and needle in str(err.value)
    outs = err.value.outputs
    assert outs[1] is None
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 24
    assert outs[2].finish_reason == "length"
    assert_pool_clean(llm.engine)


def test_stop_conditions(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, max_total_tokens=4096)
    base = llm.generate({"prompt_token_ids": [40, 41, 42]}, GREEDY)[0]
    # A stop token id: generation ends on it, and it is the last token returned.
    stop_tok = base.token_ids[5]
    out = llm.generate({"prompt_token_ids": [40, 41, 42]},
                       SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]))[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    # A stop string cuts the text before it.
    text = base.text
    needle = text[len(text) // 2: len(text) // 2 + 3]
    if needle.strip():
        out = llm.generate({"prompt_token_ids": [40, 41, 42]},
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[needle]))[0]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == needle
        assert out.text == text[: text.index(needle)]
    # min_tokens keeps the stop token away until reached.
    out = llm.generate({"prompt_token_ids": [40, 41, 42]},
                       SamplingParams(temperature=0, max_tokens=24, min_tokens=first + 3,
                                      stop_token_ids=[stop_tok]))[0]
    assert len(out.token_ids) >= first + 3
    assert_pool_clean(llm.engine)


def test_an_end_of_turn_token_named_in_generation_config_stops_generation(tiny_llama, tmp_path):
    """config.json names one EOS, generation_config.json another beside it (as Llama 3 chat checkpoints
    do): generation stops at either."""
    import json
    import shutil

    path, _ = tiny_llama
    shutil.copytree(path, tmp_path / "model")
    base = LLM(str(tmp_path / "model"), max_total_tokens=4096).generate({"prompt_token_ids": [40, 41, 42]}, GREEDY)[0]
    turn_end = next(t for t in base.token_ids[3:] if t != 2)
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, turn_end]}))
    llm = LLM(str(tmp_path / "model"), max_total_tokens=4096)
    assert llm.engine.config.eos_token_ids == (2, turn_end)
    out = llm.generate({"prompt_token_ids": [40, 41, 42]}, SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(turn_end) + 1]
    assert out.finish_reason == "stop"


def test_seeded_sampling_does_not_depend_on_batch_company(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, max_total_tokens=4096)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [9, 8, 7]}, p)[0].token_ids
    others = [{"prompt_token_ids": q} for q in prompts(5)]
    crowd = llm.generate([{"prompt_token_ids": [9, 8, 7]}] + others,
                         [p] + [SamplingParams(temperature=1.0, max_tokens=10)] * 5)[0].token_ids
    assert alone == crowd
    other_seed = llm.generate({"prompt_token_ids": [9, 8, 7]},
                              SamplingParams(temperature=0.9, seed=99, max_tokens=16, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_n_samples_are_requests_of_their_own_seeded_by_their_index(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, max_total_tokens=4096)
    p = dict(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [9, 8, 7]}, SamplingParams(n=3, seed=500, **p))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for j, o in enumerate(out.outputs):
        alone = llm.generate({"prompt_token_ids": [9, 8, 7]}, SamplingParams(seed=500 + j, **p))[0]
        assert o.token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    greedy = llm.generate({"prompt_token_ids": [9, 8, 7]}, SamplingParams(n=2, temperature=0, max_tokens=8))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(ValueError, match="n must be 1 for one engine request"):
        llm.engine.add_request([9, 8, 7], SamplingParams(n=2))
    assert_pool_clean(llm.engine)


def test_prompt_logprobs_score_each_prompt_token_as_decoding_would(tiny_llama):
    """Prompt token i + 1 gets the logprob its position's logits give it: the same number a decode step gives
    a generated token, across chunk boundaries, and with the prompt's pages already in the prefix cache."""
    path, _ = tiny_llama
    llm = LLM(path, max_total_tokens=4096, page_size=8, chunked_prefill_size=16)
    start = [5, 17, 99, 3, 42, 7, 11]
    gen = llm.generate({"prompt_token_ids": start}, SamplingParams(temperature=0, max_tokens=30, logprobs=2,
                                                                   ignore_eos=True))[0].outputs[0]
    prompt = start + gen.token_ids
    for _ in range(2):  # the second time its pages are cached; its logits are computed anyway
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1,
                                                                        prompt_logprobs=2))[0]
        scored = out.prompt_logprobs
        assert scored[0] is None and [lp.token_id for lp in scored[1:]] == prompt[1:]
        assert out.num_cached_tokens == 0
        for lp, want in zip(scored[len(start):], gen.logprobs):
            assert lp.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in lp.top] == [t for t, _ in want.top]
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    assert_pool_clean(llm.engine)


def test_a_seeded_request_continued_from_its_tokens_draws_what_it_would_have(tiny_llama):
    """A request placed again after its worker died mid-stream: prompt + the tokens it had, output_offset."""
    path, _ = tiny_llama
    llm = LLM(path, max_total_tokens=4096)
    p = dict(temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
    whole = llm.generate({"prompt_token_ids": [9, 8, 7]}, SamplingParams(max_tokens=20, **p))[0].token_ids
    rest = llm.generate({"prompt_token_ids": [9, 8, 7] + whole[:8]},
                        SamplingParams(max_tokens=12, output_offset=8, **p))[0].token_ids
    assert rest == whole[8:]
    restart = llm.generate({"prompt_token_ids": [9, 8, 7] + whole[:8]}, SamplingParams(max_tokens=12, **p))[0]
    assert restart.token_ids != whole[8:], "without the offset the draws start over"


def test_logprobs_are_those_of_the_model_distribution(tiny_llama):
    import torch

    path, hf = tiny_llama
    llm = LLM(path, max_total_tokens=4096)
    out = llm.generate({"prompt_token_ids": [3, 4, 5, 6]},
                       SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    with torch.no_grad():
        ref = hf(torch.tensor([[3, 4, 5, 6] + out.token_ids])).logits[0, 3:7].float().log_softmax(-1)
    for i, lp in enumerate(lps):
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - ref[i, lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token


def test_embedded_model_knows_the_capital_of_france():
    llm = LLM(max_total_tokens=4096)
    assert llm.engine.load_seconds < 60
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=40))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert_pool_clean(llm.engine)


def test_fp8_kv_cache_doubles_capacity_and_stays_close(tiny_llama):
    import torch

    from conftest import rel_err
    from test_models import PROMPTS, record_logits

    path, _ = tiny_llama
    sized = {dt: Engine(model_path=path, kv_cache_dtype=dt, mem_fraction_static=0.004)
             for dt in ("bfloat16", "fp8_e4m3")}
    ratio = sized["fp8_e4m3"].pool.max_total_num_tokens / sized["bfloat16"].pool.max_total_num_tokens
    assert abs(ratio - 2.0) <= 0.1
    assert sized["fp8_e4m3"].pool.data.dtype == torch.float8_e4m3fn
    del sized

    logits = {}
    for dt in ("bfloat16", "fp8_e4m3"):
        engine = Engine(model_path=path, max_total_tokens=2048, kv_cache_dtype=dt)
        seen = record_logits(engine)
        # The first token's logits of each prompt: prefill attention reads every K/V back from the pool, so
        # the FP8 rounding is in them, and both engines see exactly the same tokens.
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), rid=str(i))
        drain(engine)
        logits[dt] = torch.cat([torch.stack(seen[str(i)])[:1] for i in range(len(PROMPTS))])
        assert_pool_clean(engine)
    assert rel_err(logits["fp8_e4m3"], logits["bfloat16"]) < 5e-2


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # an LM head of its own; one tied to the embeddings
def test_fp8_lm_head_is_opt_in_and_stays_close(tiny_models, family):
    import torch

    from conftest import rel_err
    from engine.args import EngineArgs
    from kernels.fp8_linear import Fp8Linear
    from test_models import PROMPTS, record_logits

    path, hf = tiny_models[family]
    assert hf.config.tie_word_embeddings == (family == "qwen2")
    logits = {}
    for head in (False, True):
        engine = Engine(model_path=path, max_total_tokens=2048, quantization="fp8", quantize_lm_head=head)
        assert isinstance(getattr(engine.model, "lm_head", None), Fp8Linear) == head
        seen = record_logits(engine)
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=1), rid=str(i))
        drain(engine)
        logits[head] = torch.cat([seen[str(i)][0][None] for i in range(len(PROMPTS))])
    # The lookup still reads the embedding table as it was.
    assert engine.model.embed_tokens.weight.dtype != torch.float8_e4m3fn
    assert rel_err(logits[True], logits[False]) < 0.1
    assert not torch.equal(logits[True], logits[False])
    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization"):
        EngineArgs(quantize_lm_head=True)


def test_fp8_weights_stay_close_and_quantized_checkpoints_are_refused(tiny_llama, tmp_path):
    import json
    import shutil

    import torch

    from conftest import rel_err
    from kernels.fp8_linear import Fp8Linear
    from test_models import PROMPTS, record_logits

    path, _ = tiny_llama
    logits = {}
    for q in (None, "fp8"):
        engine = Engine(model_path=path, max_total_tokens=2048, quantization=q)
        seen = record_logits(engine)
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=1), rid=str(i))
        drain(engine)
        logits[q] = torch.cat([seen[str(i)][0][None] for i in range(len(PROMPTS))])
    assert isinstance(engine.model.layers[0].mlp.down_proj, Fp8Linear)
    assert rel_err(logits["fp8"], logits[None]) < 0.1
    assert not torch.equal(logits["fp8"], logits[None])

    quantized = tmp_path / "q"
    shutil.copytree(path, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized already.*awq"):
        Engine(model_path=str(quantized), max_total_tokens=1024, quantization="fp8")
    with pytest.raises(ValueError, match="quantized already.*Q4_1"):
        Engine(max_total_tokens=1024, quantization="fp8")  # the embedded Q4_1 GGUF


def test_overlapped_steps_give_the_same_tokens_as_synchronous_ones(tiny_llama):
    """Step N+1 is launched before step N's tokens are read back; nothing about the output may change."""
    path, _ = tiny_llama
    sync = LLM(path, max_total_tokens=4096, disable_overlap_schedule=True)
    base = sync.generate({"prompt_token_ids": [40, 41, 42]}, GREEDY)[0]
    stop_tok = base.token_ids[4]
    mix = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=8, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.7, seed=3, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=1, ignore_eos=True),
    ]
    inputs = [{"prompt_token_ids": [40, 41, 42] if i in (2, 3) else p} for i, p in enumerate(prompts(len(mix)))]
    want = sync.generate(inputs, mix)
    overlapped = LLM(path, max_total_tokens=4096)
    got = overlapped.generate(inputs, mix)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
        assert [lp.token_id for lp in a.outputs[0].logprobs or []] == [lp.token_id for lp in b.outputs[0].logprobs or []]
    assert got[2].finish_reason == "stop" and got[2].token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]
    assert len(got[3].token_ids) >= 8
    assert_pool_clean(overlapped.engine)


def test_pages_let_go_during_a_step_in_flight_are_held_until_it_completes(tiny_llama):
    path, _ = tiny_llama
    engine = Engine(model_path=path, max_total_tokens=1024, disable_radix_cache=True)
    free0 = engine.allocator.num_free
    a = engine.add_request(prompts(1)[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert a.pending == 1  # the second step's token is still "on the device"
    held = len(a.pages)
    assert engine.abort(a.rid)
    # The step in flight may still write a's KV: its pages must not be handed out yet.
    assert engine.allocator.num_free == free0 - held
    engine.check()
    drain(engine)
    assert a.finish_reason == "abort" and a.pending == 0
    assert engine.allocator.num_free == free0
    assert_pool_clean(engine)


def test_both_kv_page_layouts_give_the_same_tokens(tiny_llama):
    path, _ = tiny_llama
    outs = {}
    for layout in ("NHD", "HND"):
        llm = LLM(path, max_total_tokens=4096, kv_layout=layout)
        assert llm.engine.pool.layout == layout
        outs[layout] = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts(4)], GREEDY)]
        assert_pool_clean(llm.engine)
    assert outs["NHD"] == outs["HND"]


def test_a_prompt_is_shared_from_the_cache_as_soon_as_its_first_token_is_out(tiny_llama):
    path, _ = tiny_llama
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=8)
    prefix = [(i * 31) % 400 + 7 for i in range(64)]
    first = engine.add_request(prefix + [5], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while first.num_output < 2:
        engine.step()
    assert not first.finished
    # The first request is still decoding: its prompt pages are in the cache already.
    second = engine.add_request(prefix + [9], GREEDY)
    engine.step()
    assert second.cached_tokens == 64
    drain(engine)
    assert_pool_clean(engine)


def test_flashinfer_is_refused_page_sizes_it_was_not_verified_for():
    """FlashInfer's decode kernel read out of bounds with 64-token pages on the GPU, which would take the whole
    worker down: such a configuration fails when it is made, with the way out in the message."""
    from engine.args import EngineArgs

    assert EngineArgs(attention_backend="flashinfer", page_size=32, device="cuda").page_size == 32
    assert EngineArgs(attention_backend="triton", page_size=64, device="cuda").page_size == 64
    with pytest.raises(ValueError, match="use --attention-backend triton"):
        EngineArgs(attention_backend="flashinfer", page_size=64, device="cuda")


@pytest.mark.parametrize("kv", ["int8", "uint8", "bool", "float64", "fp8"])
def test_kv_cache_dtypes_that_cannot_hold_k_and_v_are_refused(kv):
    """An int8 pool once served garbage (K and V truncated to integers, nothing to scale them back): only the
    float types and the two FP8 formats are taken, and the error lists them."""
    from engine.args import EngineArgs

    for ok in ("auto", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"):
        EngineArgs(kv_cache_dtype=ok)
    with pytest.raises(ValueError, match=f"unknown kv_cache_dtype '{kv}'; choose from .*fp8_e4m3"):
        EngineArgs(kv_cache_dtype=kv)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_attention_backends_are_refused_on_a_cpu_by_name(backend, monkeypatch):
    """On a CPU, `--attention-backend triton` failed deep inside Triton ("0 active drivers") once the model had
    loaded; it is refused with the way out before anything loads. Triton's interpreter (TRITON_INTERPRET=1,
    as the tests run its kernels) still may."""
    from engine.args import EngineArgs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=f"the {backend} backend runs on a GPU.*use --attention-backend torch"):
        EngineArgs(attention_backend=backend, device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backend == "triton":
        EngineArgs(attention_backend=backend, device="cpu")


def test_flashinfer_is_refused_models_whose_head_groups_its_decode_kernel_lacks():
    """FlashInfer's decode kernel stopped the worker at the first decode step of a model with seven query heads
    per KV head (Qwen2.5-0.5B): such a model is refused when the backend is made, before any request, and the
    error names the way out. Llama-3.1-8B's four passes; SmolLM2-135M's three is not among the sizes verified
    and is refused too."""
    from engine.config import ModelConfig
    from kernels.attention.flashinfer_backend import check_supported

    def cfg(heads, kv_heads):
        return ModelConfig("llama", 100, heads * 64, 64, 1, heads, kv_heads, 64, 4096, 1e-6, 1e4)

    check_supported(cfg(32, 8))
    check_supported(cfg(8, 8))
    for heads, kv in ((14, 2), (9, 3)):
        with pytest.raises(ValueError, match="use --attention-backend triton"):
            check_supported(cfg(heads, kv))


@pytest.mark.parametrize("head_dim", [32, 80, 96, 192])
def test_flashinfer_is_refused_head_sizes_its_kernels_are_not_built_for(head_dim):
    """FlashInfer's prefill kernel stopped the worker at the first prefill of a model with 32-dimensional heads
    (an H100), and is reported to fault or return wrong values for sizes that are not a multiple of 64; such a
    model is refused before any request, naming the way out."""
    from engine.config import ModelConfig
    from kernels.attention.flashinfer_backend import check_supported

    for ok in (64, 128, 256):
        check_supported(ModelConfig("llama", 100, 8 * ok, 64, 1, 8, 2, ok, 4096, 1e-6, 1e4))
    with pytest.raises(ValueError, match=f"head sizes .* is {head_dim}: use --attention-backend triton"):
        check_supported(ModelConfig("llama", 100, 8 * head_dim, 64, 1, 8, 2, head_dim, 4096, 1e-6, 1e4))


def _break(path, how: str) -> str:
    if how == "config not JSON":
        open(os.path.join(path, "config.json"), "w").write("{bad")
        return r"config\.json: not valid JSON"
    if how == "config lacks a field":
        cfg = json.load(open(os.path.join(path, "config.json")))
        del cfg["hidden_size"]
        json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
        return r"config\.json: not a usable model config \(KeyError: 'hidden_size'\)"
    if how == "generation_config a list":
        open(os.path.join(path, "generation_config.json"), "w").write("[1, 2]")
        return r"generation_config\.json: a JSON object was expected, not list"
    if how == "tokenizer not JSON":
        open(os.path.join(path, "tokenizer.json"), "w").write('{"x": 1')
        return r"tokenizer\.json: not a readable tokenizer"
    if how == "tokenizer_config not JSON":
        open(os.path.join(path, "tokenizer_config.json"), "w").write("\xff{")
        return r"tokenizer_config\.json: not valid JSON"
    weights = os.path.join(path, "model.safetensors")
    data = open(weights, "rb").read()
    if how == "weights cut short":
        open(weights, "wb").write(data[: len(data) - 1000])
    elif how == "weights header cut":
        open(weights, "wb").write(data[:6])
    return r"model\.safetensors: not a readable safetensors file"


@pytest.mark.parametrize("how", ["config not JSON", "config lacks a field", "generation_config a list",
                                 "tokenizer not JSON", "tokenizer_config not JSON", "weights cut short",
                                 "weights header cut"])
def test_a_broken_checkpoint_is_refused_naming_the_file_at_fault(tiny_llama, tmp_path, how):
    """An operator's checkpoint that is damaged (a copy cut short, a hand edit gone wrong) stops the worker
    with one ValueError naming the file and what is wrong with it, not a parser's message without a file."""
    src, _ = tiny_llama
    path = str(tmp_path / "ckpt")
    shutil.copytree(src, path)
    expected = _break(path, how)
    with pytest.raises(ValueError, match=expected):
        Engine(model_path=path)


def test_a_kv_pool_that_cannot_exist_is_refused_with_its_sizes(tiny_llama):
    """A page larger than the memory budget, or --max-total-tokens beyond the device, stops the worker with the
    sizes involved and the flags to change (it was a RuntimeError with a traceback, or torch's OOM)."""
    path, _ = tiny_llama
    with pytest.raises(ValueError, match=r"no room for the KV pool: .* a page of 10000000 tokens takes .*--page-size"):
        Engine(model_path=path, page_size=10_000_000)
    with pytest.raises(ValueError, match=r"KV pool of 1,000,000,000,0\d\d tokens .* does not fit on cpu"):
        Engine(model_path=path, max_total_tokens=10**12)


def test_weights_digest_tells_checkpoints_of_one_shape_apart(tiny_llama, tmp_path):
    """Workers pair only with equal digests: a copy of a checkpoint elsewhere has its digest, the same shapes
    with other values (a fine-tune) do not, and random weights are alike only on one kind of device and dtype."""
    from safetensors.torch import load_file, save_file

    from engine.args import EngineArgs
    from engine.engine import weights_digest
    from engine.weights import checkpoint_digest

    src, _ = tiny_llama
    copy = shutil.copytree(src, tmp_path / "copy")
    tuned = shutil.copytree(src, tmp_path / "tuned")
    tensors = load_file(os.path.join(tuned, "model.safetensors"))
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, os.path.join(tuned, "model.safetensors"), metadata={"format": "pt"})

    assert checkpoint_digest(src) == checkpoint_digest(str(copy))
    assert checkpoint_digest(src) != checkpoint_digest(str(tuned))
    dummy = EngineArgs(model_path=src, load_format="dummy")
    assert weights_digest(src, dummy) == weights_digest(str(tuned), dummy) != checkpoint_digest(src)
    assert weights_digest(src, dummy) != weights_digest(src, EngineArgs(model_path=src, load_format="dummy",
                                                                        dtype="bfloat16"))
    engine = Engine(model_path=str(copy))
    assert engine.weights_digest == checkpoint_digest(src)
    assert engine.tokenizer.vocab_digest() == Engine(model_path=src).tokenizer.vocab_digest()
