"""Tensor parallelism on N GPUs of one host: decode steps of one engine of N ranks against one of one rank.

    python -m bench.tp --tokenizer DIR [--tp 2] [--config bench/configs/llama-3.1-8b.json] [--json rows.json]
    PDSERVE_TP_BACKEND=gloo python -m bench.tp --tokenizer DIR --share-gpu [--config ...]

The model is the config's layer shapes with DIR's tokenizer (bench/pd.py's model_dir_for), its weights random
(`--load-format dummy`). Each rank draws its own shard with the same seed, so a TP-N model is not the TP-1
model cut in N: the rows time the two, they do not compare their tokens. Both engines run as `LLM` does
(engine/tp_worker.py: rank 0 here, ranks 1..N-1 as child processes), CUDA graphs and all, so each step's
time includes the all-reduces of every layer and the mirroring of each call to the other ranks. The ratio
is the TP-1 step over N TP-N steps: 1.0 when N GPUs split the step's memory traffic perfectly.

`--share-gpu` checks tokens instead, on a machine with one GPU: every rank on GPU 0, which NCCL refuses and
gloo allows (PDSERVE_TP_BACKEND=gloo: collectives through the host, no CUDA graphs, slow). The model is a
random checkpoint written once and loaded by both engines, so TP-N is TP-1 cut in N: the rows give greedy
tokens of TP-N against TP-1 and their first-token logits.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from bench.measure import decode_step_time
from bench.pd import model_dir_for

HERE = os.path.dirname(os.path.abspath(__file__))


def tp_rows(model_dir: str, tp: int, ctx: int = 1024, steps: int = 64, batches=(1, 64), load_format: str = "dummy",
            **engine_args) -> list:
    from engine import LLM

    engine_args = {"max_total_tokens": max(batches) * (ctx + steps + 64) + 4096, "disable_radix_cache": True,
                   "load_format": load_format, **engine_args}
    times = {}
    for size in (1, tp):
        with LLM(model_dir, tp_size=size, **engine_args) as llm:
            for b in batches:
                times[(size, b)] = decode_step_time(llm.engine, b, ctx, steps)
                print(f"  TP-{size} batch {b}: {times[(size, b)] * 1e3:.3f} ms a step", flush=True)
    return [(f"decode step, batch {b}, {ctx} ctx: TP-{tp} ms (TP-1 ms); ratio TP-1 / ({tp} x TP-{tp})",
             times[(tp, b)] * 1e3, times[(1, b)] * 1e3, times[(1, b)] / (tp * times[(tp, b)]), "(for comparison)")
            for b in batches]


def write_checkpoint(model_dir: str, seed: int = 0) -> None:
    """model.safetensors in model_dir: random weights (engine.loader.random_init) of its config, in the
    checkpoint's names, so that engines of any --tp load the same model."""
    import torch
    from safetensors.torch import save_file

    from engine.config import ModelConfig
    from engine.loader import build_model

    config = ModelConfig.from_dir(model_dir)
    model = build_model(config, torch.bfloat16, torch.device("cpu"), seed=seed)
    c = model.config
    split = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), [c.q_size, c.kv_size, c.kv_size]),
             "gate_up_proj": (("gate_proj", "up_proj"), [c.intermediate_size] * 2)}
    tensors = {}
    for name, p in model.named_parameters():
        merged = name.split(".")[-2] if "." in name else ""
        if merged in split:
            parts, sizes = split[merged]
            for part, t in zip(parts, p.detach().split(sizes, dim=0)):
                tensors["model." + name.replace(merged, part)] = t.contiguous()
        else:
            tensors["model." + name] = p.detach().contiguous()
    save_file(tensors, f"{model_dir}/model.safetensors")


def shared_gpu_rows(model_dir: str, tp: int, prompts: int = 8, tokens: int = 32, **engine_args) -> list:
    """Greedy tokens and first-token logits of TP-`tp` against TP-1, all loading model_dir's checkpoint. Random
    weights leave near-ties between the top logits, so bf16 rounding alone flips greedy tokens: the fp32 runs
    say whether TP computes what one rank does, and the bf16 runs' distance from fp32 whether TP adds more
    rounding than TP-1 has."""
    import torch

    from bench.checks import record_logits
    from engine import LLM, SamplingParams

    with open(f"{model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    g = torch.Generator().manual_seed(3)
    batch = [{"prompt_token_ids": torch.randint(10, vocab, (int(n),), generator=g).tolist()}
             for n in torch.randint(20, 400, (prompts,), generator=g)]
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine_args = {"max_total_tokens": prompts * (400 + tokens) + 1024, "disable_radix_cache": True, **engine_args}
    fp32 = {"dtype": "float32", "attention_backend": "torch"}
    n = f"TP-{tp}"
    runs = {"TP-1": (1, {}), n: (tp, {}), "fp32 TP-1": (1, fp32), f"fp32 {n}": (tp, fp32)}
    out, first = {}, {}
    for name, (size, extra) in runs.items():
        with LLM(model_dir, tp_size=size, **engine_args, **extra) as llm:
            seen = record_logits(llm.engine)
            out[name] = [o.token_ids for o in llm.generate(batch, greedy)]
            first[name] = seen[0].float()  # the first step prefills every prompt that fits its budget
            print(f"  {name}: {llm.engine.pool.kv_heads} KV heads a rank, CUDA graphs "
                  f"{llm.engine.runner.graphs is not None}", flush=True)

    def same(a, b):
        return sum(x == y for x, y in zip(out[a], out[b]))

    def agree(a, b):
        return min(next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(out[a], out[b]))

    def err(a, b):
        return ((first[a] - first[b]).abs().max() / first[b].abs().max()).item()

    ref = "fp32 TP-1"
    return [(f"{n} with its ranks on one GPU, greedy tokens vs TP-1 (bf16), {prompts} prompts x {tokens}: prompts "
             f"equal (fewest tokens equal before a difference: {agree('TP-1', n)})", same("TP-1", n), prompts,
             same("TP-1", n) / prompts, "(check)"),
            (f"the same in fp32: prompts equal; first-token logits max|d|/max|ref| "
             f"{err(f'fp32 {n}', ref):.1e}", same(ref, f"fp32 {n}"), prompts, same(ref, f"fp32 {n}") / prompts,
             "== 1 (TP computes what one rank does)"),
            (f"bf16 first-token logits of {first[n].shape[0]} prompts vs fp32 TP-1: max|d|/max|ref|, {n} (TP-1); "
             f"greedy prompts equal {same(ref, n)} ({same(ref, 'TP-1')})",
             err(n, ref), err("TP-1", ref), err(n, ref) / err("TP-1", ref) if err("TP-1", ref) else None,
             "<= 1.5 (TP adds little rounding)")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    ap.add_argument("--config", default=None, help="model shape (default: the 8B's; with --share-gpu the 0.5B's)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--share-gpu", action="store_true", help="all ranks on GPU 0: tokens against TP-1, not times")
    args = ap.parse_args()
    config = args.config or os.path.join(HERE, "configs", "qwen2.5-0.5b.json" if args.share_gpu else "llama-3.1-8b.json")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_for(config, args.tokenizer, tmp)
        if args.share_gpu:
            write_checkpoint(model_dir)
            rows = shared_gpu_rows(model_dir, args.tp, device="cuda:0")
        else:
            rows = tp_rows(model_dir, args.tp, args.ctx, args.steps)
    print("| figure | value | peer | ratio | target |\n|---|---|---|---|---|")
    for name, value, peer, ratio, target in rows:
        print(f"| {name} | {value:.4g} | {peer:.4g} | {'' if ratio is None else f'{ratio:.3f}'} | {target} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
