"""CPU benchmark of the embedded model against transformers' generate on the same GGUF file.

    python -m bench.cpu [--max-tokens 128] [--concurrency 16] [--prefill-tokens 2048]

Prints load time, batch-1 decode tokens/s, total tokens/s for N concurrent requests, prefill tokens/s of one
long prompt (its time to the first token), the same figures for transformers, and the ratios. Both run in this process, on the same threads, one after the other.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from engine import LLM, SamplingParams
from engine.loader import embedded_model_path

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.", "Write a haiku about rain.",
    "What is 17 times 23?", "Name three primary colors.", "How do airplanes fly?", "Tell me a short joke.",
    "What causes the seasons on Earth?", "Describe a cat in one sentence.", "What is machine learning?",
    "Give me a tip for learning to code.", "Why is the sky blue?", "What is the boiling point of water?",
    "Summarise the plot of Cinderella.", "List two benefits of exercise.", "What is a prime number?",
]


def long_prompt(prompts: list[list[int]], n: int) -> list[int]:
    ids = [t for p in prompts for t in p]
    return (ids * (n // len(ids) + 1))[:n]


def ours(max_tokens: int, concurrency: int, prefill_tokens: int) -> dict:
    t0 = time.perf_counter()
    llm = LLM(max_total_tokens=32768)
    load = time.perf_counter() - t0
    tok = llm.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    # Like transformers' min_new_tokens: EOS is banned until max_tokens, so both generate the same length.
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    engine = llm.engine
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4))  # warm-up

    req = engine.add_request(prompts[0], params)
    t_first = None
    while engine.has_work():
        engine.step()
        if t_first is None and req.num_output >= 1:
            t_first = time.perf_counter()
    b1 = (req.num_output - 1) / (time.perf_counter() - t_first)
    b1_tokens = req.output_ids

    batch = [prompts[i % len(prompts)] for i in range(concurrency)]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    dt = time.perf_counter() - t0
    total = sum(len(o.token_ids) for o in outs) / dt
    engine.check()

    long = long_prompt(prompts, prefill_tokens)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": long}], SamplingParams(temperature=0, max_tokens=1))[0]
    prefill = (prefill_tokens - out.num_cached_tokens) / (time.perf_counter() - t0)
    return {"load": load, "b1": b1, "batch": total, "prefill": prefill, "tokens": b1_tokens, "prompt": prompts[0],
            "prompts": prompts}


def transformers_ref(max_tokens: int, prompt: list[int], long: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    ids = torch.tensor([prompt])

    def gen(n, ids=ids):
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones_like(ids))
            return time.perf_counter() - t, out[0, ids.shape[1]:].tolist()

    gen(4)  # warm-up
    t1, _ = gen(1)
    tn, tokens = gen(max_tokens)
    tp, _ = gen(1, torch.tensor([long]))
    return {"load": load, "b1": (max_tokens - 1) / (tn - t1), "prefill": len(long) / tp, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    a = ours(args.max_tokens, args.concurrency, args.prefill_tokens)
    h = transformers_ref(args.max_tokens, a["prompt"], long_prompt(a["prompts"], args.prefill_tokens))
    same = sum(1 for x, y in zip(a["tokens"], h["tokens"]) if x == y)
    prefix = next((i for i, (x, y) in enumerate(zip(a["tokens"], h["tokens"])) if x != y), len(a["tokens"]))
    rows = [
        ("load time (s), warm disk cache", f"{a['load']:.2f}", f"{h['load']:.2f}", f"{h['load'] / a['load']:.1f}x faster"),
        ("batch-1 decode tokens/s", f"{a['b1']:.1f}", f"{h['b1']:.1f}", f"{a['b1'] / h['b1']:.2f}x"),
        (f"{args.concurrency} concurrent, total tokens/s", f"{a['batch']:.1f}", f"{h['b1']:.1f} (its batch-1)",
         f"{a['batch'] / h['b1']:.2f}x"),
        (f"prefill of a {args.prefill_tokens}-token prompt, tokens/s", f"{a['prefill']:.0f}", f"{h['prefill']:.0f}",
         f"{a['prefill'] / h['prefill']:.2f}x"),
        ("greedy tokens equal to transformers", f"{prefix}/{len(a['tokens'])} (prefix)", "", f"{same} equal"),
    ]
    print()
    print("| figure | pdserve | transformers | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
