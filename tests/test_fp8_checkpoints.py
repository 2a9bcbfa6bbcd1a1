"""Checkpoints quantized to FP8 by other tools are served as they are: what transformers computes with the
checkpoint's dequantized weights, in every format that writes per-tensor or per-channel scales."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import build_hf_model, make_tokenizer_files, rel_err
from engine import Engine, SamplingParams
from test_models import PROMPTS, hf_logits, record_logits
from test_tensor_parallel import leave_group, run_ranks

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


BLOCK = [24, 48]  # (a tiny model's rows and columns are not all multiples of it: partial tiles at the edges)


def quantization_config(method: str, strategy: str, ignore: list[str]) -> dict:
    if method == "compressed-tensors":  # as llm-compressor writes FP8 (static, per tensor) and FP8-dynamic
        activations = ({"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True} if strategy != "tensor"
                       else {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False})
        weights = {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True, "dynamic": False}
        if strategy == "block":
            weights["block_structure"] = BLOCK
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations,
                                              "weights": weights}}}
    if method == "fp8":  # vLLM's serialization; with blocks, transformers' (Qwen3 and DeepSeek FP8 releases)
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignore}
        if strategy == "block":
            qc["weight_block_size"] = BLOCK
        return qc
    return {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ignore, "activation_scale_ub": 1200.0}


def write_fp8_checkpoint(path: str, hf, method: str, strategy: str, ignore: list[str]) -> dict[str, torch.Tensor]:
    """hf's weights quantized to e4m3 with a scale per tensor or per output row, saved as `method` saves them;
    returns the dequantized state dict, which transformers then runs as the reference."""
    from safetensors.torch import save_file

    from engine.checkpoint_quant import Fp8Checkpoint

    spec = Fp8Checkpoint(method, tuple(ignore))
    stored, ref = {}, {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.split(".")[-1] not in LINEARS or not spec.quantized(module):
            stored[name] = ref[name] = t.contiguous()
            continue
        w = t.float()
        if strategy == "block":  # a scale per BLOCK tile, the edge tiles partial
            br, bc = BLOCK
            tiles = torch.nn.functional.pad(w, (0, -w.shape[1] % bc, 0, -w.shape[0] % br)).unflatten(0, (-1, br))
            amax = tiles.unflatten(2, (-1, bc)).abs().amax(dim=(1, 3))
            scale = (amax / 448.0).clamp(min=1e-12)
            full = scale.repeat_interleave(br, 0)[: w.shape[0]].repeat_interleave(bc, 1)[:, : w.shape[1]]
            q = (w / full).clamp(-448.0, 448.0).to(FP8)
            stored[name] = q
            stored[f"{module}.weight_scale_inv" if method == "fp8" else f"{module}.weight_scale"] = scale
            ref[name] = q.float() * full
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
        scale = (amax / 448.0).clamp(min=1e-12)
        q = (w / scale).clamp(-448.0, 448.0).to(FP8)
        stored[name] = q
        if strategy == "channel":
            stored[f"{module}.weight_scale"] = scale if method != "fp8" else scale.view(-1)
        else:
            stored[f"{module}.weight_scale"] = scale.reshape(1) if method == "compressed-tensors" else scale.reshape(())
            stored[f"{module}.input_scale"] = torch.tensor([0.02])  # static activations: not used
        ref[name] = q.float() * scale
    save_file(stored, os.path.join(path, "model.safetensors"))
    hf.config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(method, strategy, ignore)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    make_tokenizer_files(path)
    return ref


CASES = [
    ("llama", "compressed-tensors", "channel", ["lm_head"]),
    ("qwen2", "compressed-tensors", "tensor", ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"]),
    ("llama", "fp8", "tensor", []),
    ("mistral", "fbgemm_fp8", "channel", ["lm_head", "model.layers.0.self_attn"]),
    ("qwen2", "fp8", "block", ["lm_head"]),
    ("llama", "compressed-tensors", "block", ["lm_head", "re:.*layers\\.0\\.mlp\\..*"]),
]


@pytest.mark.parametrize("family,method,strategy,ignore", CASES)
def test_fp8_checkpoint_serves_what_transformers_computes_with_its_weights(tmp_path, family, method, strategy,
                                                                           ignore):
    """Each format's tensors land in the FP8 projections (q, k, v with scales of their own in one merged
    projection); the linears a checkpoint leaves out stay in the model's dtype; static activation scales
    are not used; block-wise scales are dequantized as they load; the tokens and logits are transformers'
    on the dequantized weights."""
    from engine.checkpoint_quant import SERVED  # noqa: F401  (the module under test)
    from kernels.fp8_linear import Fp8Linear

    hf = build_hf_model(family, seed=7)
    ref = write_fp8_checkpoint(str(tmp_path), hf, method, strategy, ignore)
    engine = Engine(model_path=str(tmp_path), max_total_tokens=2048)
    layers = engine.model.layers
    fp8 = [[isinstance(getattr(getattr(layer, part), proj), Fp8Linear)
            for part, proj in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                               ("mlp", "down_proj"))] for layer in layers]
    expect = [[strategy != "block"] * 4 for _ in layers]
    if "model.layers.0.self_attn" in ignore:
        expect[0][:2] = [False, False]
    if any("down_proj" in i for i in ignore):
        expect[1][3] = False
    assert fp8 == expect
    q = layers[0].self_attn.qkv_proj
    if isinstance(q, Fp8Linear):  # the merged projection holds each checkpoint linear's rows exactly
        c = engine.config
        w = (q.weight_rows.float() * q.scale.view(-1, 1)).split([c.q_size, c.kv_size, c.kv_size])
        for part, name in zip(w, ("q_proj", "k_proj", "v_proj")):
            assert torch.equal(part, ref[f"model.layers.0.self_attn.{name}.weight"])

    reference = build_hf_model(family, seed=7)
    reference.load_state_dict(ref, strict=False)  # (a tied head is the embedding)
    seen = record_logits(engine)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reqs = [engine.add_request(p, greedy) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    for p, r in zip(PROMPTS, reqs):
        full = p + r.output_ids
        expected = hf_logits(reference, full)[len(p) - 1: len(full) - 1]
        assert rel_err(torch.stack(seen[r.rid]), expected) < 1e-4
        assert r.output_ids == expected.argmax(-1).tolist()


def test_fp8_checkpoint_is_refused_where_it_cannot_be_served(tmp_path):
    hf = build_hf_model("llama", seed=7)
    write_fp8_checkpoint(str(tmp_path), hf, "compressed-tensors", "channel", ["lm_head"])
    with pytest.raises(ValueError, match="quantized already"):
        Engine(model_path=str(tmp_path), max_total_tokens=2048, quantization="fp8")
    with pytest.raises(ValueError, match="quantized"):
        Engine(model_path=str(tmp_path), max_total_tokens=2048, load_format="dummy")

    def with_config(qc: dict) -> str:
        with open(tmp_path / "config.json") as f:
            config = json.load(f)
        config["quantization_config"] = qc
        with open(tmp_path / "config.json", "w") as f:
            json.dump(config, f)
        return str(tmp_path)

    refusals = [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq': not an FP8 format"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "block-wise scales"),
        ({**quantization_config("compressed-tensors", "channel", []), "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128}}}},
         "weight scales by group"),
        (quantization_config("compressed-tensors", "channel", ["model.layers.0.self_attn.k_proj"]),
         "q_proj, k_proj, v_proj are not all quantized"),
    ]
    for qc, message in refusals:
        with pytest.raises(ValueError, match=message):
            Engine(model_path=with_config(qc), max_total_tokens=2048)

    # A quantized LM head (this model's head stays in its dtype).
    from safetensors.torch import load_file, save_file

    with_config(quantization_config("compressed-tensors", "channel", []))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    head = tensors["lm_head.weight"].float()
    scale = head.abs().amax(dim=1, keepdim=True) / 448.0
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = (head / scale).to(FP8), scale
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="quantized where this model is not"):
        Engine(model_path=str(tmp_path), max_total_tokens=2048)


def fp8_rank_main(rank: int, size: int, addr: str, path: str, out: str) -> None:
    engine = Engine(model_path=path, max_total_tokens=2048, tp_size=size, tp_rank=rank, dist_init_addr=addr)
    seen = record_logits(engine)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reqs = [engine.add_request(p, greedy, rid=f"g{i}") for i, p in enumerate(PROMPTS)]
    while engine.has_work():
        engine.step()
    torch.save({"outputs": {r.rid: r.output_ids for r in reqs},
                "logits": {k: torch.stack(v) for k, v in seen.items()}}, f"{out}.{rank}")
    leave_group()


def test_two_ranks_split_an_fp8_checkpoint_and_compute_what_one_does(tmp_path):
    """Row scales follow their rows to the rank that holds them (q, k, v, gate, up); the projections split
    by their input (o, down) keep every row's scale."""
    hf = build_hf_model("qwen2", seed=8)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_fp8_checkpoint(str(ckpt), hf, "compressed-tensors", "channel", ["lm_head"])
    ranks = run_ranks(fp8_rank_main, str(ckpt), str(tmp_path / "tp"))
    single = Engine(model_path=str(ckpt), max_total_tokens=2048)
    seen = record_logits(single)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reqs = [single.add_request(p, greedy, rid=f"g{i}") for i, p in enumerate(PROMPTS)]
    while single.has_work():
        single.step()
    for r in reqs:
        assert ranks[0]["outputs"][r.rid] == ranks[1]["outputs"][r.rid] == r.output_ids
        assert rel_err(ranks[0]["logits"][r.rid], torch.stack(seen[r.rid])) < 1e-4
