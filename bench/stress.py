"""A randomized run of one engine, audited: requests in every sampling mode, prompts that share prefixes (the
radix cache on), bursts of samples of one prompt, a KV pool small enough to retract, aborts at random. Every
finished request is checked (tokens inside the vocabulary, its length, stop ids and min_tokens, logprobs), and
the page accounting every 250 steps and at the end.

    python3 -m bench.stress [--steps 4000] [--smoke]

On a GPU it runs CUDA graphs with overlapped steps, steps not overlapped, no graphs, and an FP8 KV pool. It found, on an H200, a graph step that could not take the tokens of an eager step with more rows
than its largest bucket, Triton decode that did not compile for an FP8 pool, and a FlashInfer decode kernel
that stops at a group of seven query heads (docs/benchmarks.md, Z53).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from bench.measure import HERE, SMOKE_CONFIG, build, random_prompt
from engine.args import EngineArgs
from engine.engine import Engine
from engine.sampling_params import SamplingParams

MODES = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=20),
         dict(temperature=1.1, min_p=0.1), dict(temperature=0.9, repetition_penalty=1.2),
         dict(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3), dict(temperature=0.8, logprobs=3),
         dict(temperature=0, logprobs=0), dict(temperature=1.0, top_k=5, top_p=0.5, min_p=0.05)]


def audit(r, vocab: int) -> list[tuple]:
    """What is wrong with finished request r (empty if nothing)."""
    out, p, bad = r.output_ids, r.params, []
    if any(not 0 <= t < vocab for t in out):
        bad.append((r.rid, "token outside the vocabulary", [t for t in out if not 0 <= t < vocab][:4]))
    if r.finish_reason == "abort":
        return bad
    if len(out) > p.max_tokens:
        bad.append((r.rid, "more tokens than max_tokens", len(out), p.max_tokens))
    if r.finish_reason == "length" and len(out) != p.max_tokens and len(r.tokens) != r.max_len:
        bad.append((r.rid, "length finish before max_tokens", len(out), p.max_tokens))
    if r.finish_reason == "stop" and (not out or out[-1] not in r.stop_ids or len(out) < p.min_tokens):
        bad.append((r.rid, "stop without a stop id, or before min_tokens", out[-1:], p.min_tokens))
    if any(t in r.stop_ids for t in out[:-1]):
        bad.append((r.rid, "a stop id inside the output"))
    if p.logprobs is not None and len(r.logprobs) != len(out):
        bad.append((r.rid, "logprobs for each token", len(r.logprobs), len(out)))
    if p.temperature == 0 and p.logprobs:
        for lp in r.logprobs:
            if lp.top and lp.top[0][1] > lp.logprob + 1e-3:
                bad.append((r.rid, "a greedy token below the top logprob", lp.token_id, lp.top[0]))
                break
    return bad


def run(model, vocab: int, steps: int, seed: int = 0, max_prompt: int = 1500, setup=None, engine=None,
        **engine_args) -> dict:
    """`steps` engine steps under random load; returns counts and the problems found. `setup(engine)`, if
    given, is called on the engine first (a test swaps in graphs that run on a CPU). `engine`: one made
    already (a tensor-parallel LLM's), in place of one built from `model` and `engine_args`."""
    rng = random.Random(seed)
    e = engine or Engine(EngineArgs(**engine_args), model=model)
    if setup is not None:
        setup(e)
    prefixes = [random_prompt(rng.randint(min(16, max_prompt // 2), max_prompt // 2), vocab, 1000 + i) for i in range(6)]
    lengths = [n for n in (1, 2, 5, 17, 100, 300, 700, 1200) if n <= max_prompt]
    live, bad = {}, []
    done = aborted = tokens = 0
    t0 = time.perf_counter()

    def finish(r):
        nonlocal done, tokens
        bad.extend(audit(r, vocab))
        done += 1
        tokens += r.num_output

    for step in range(steps):
        if len(live) < 40 and rng.random() < 0.35:
            samples = rng.random() < 0.2  # a burst of samples of one prompt, as `n` sends them
            for i in range(rng.randint(1, 4)):
                if not (samples and i):
                    head = rng.choice(prefixes)[: rng.randint(1, max_prompt // 2)] if rng.random() < 0.5 else []
                    prompt = (head + random_prompt(rng.choice(lengths), vocab, rng.randrange(10 ** 9)))[:max_prompt]
                fields = dict(rng.choice(MODES), max_tokens=rng.randint(1, 120), ignore_eos=rng.random() < 0.5,
                              seed=rng.choice([None, rng.randrange(2 ** 63)]))
                if rng.random() < 0.2:
                    fields["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 50))]
                if rng.random() < 0.2:
                    fields["min_tokens"] = rng.randint(0, fields["max_tokens"])
                r = e.add_request(prompt, SamplingParams(**fields))
                live[r.rid] = r
        if live and rng.random() < 0.04:
            e.abort(rng.choice(list(live)))
            aborted += 1
        e.step()
        for rid, r in list(live.items()):
            if r.finished:
                finish(live.pop(rid))
        if step % 250 == 249:
            e.sync()
            e.check()
    while e.has_work():
        e.step()
    e.sync()
    for r in live.values():
        finish(r)
    e.check()
    stats = e.stats()
    return dict(seconds=time.perf_counter() - t0, requests=done, aborted=aborted, tokens=tokens,
                retracted=stats["retracted"], prefix_hits=stats["prefix_hit_tokens"], problems=bad)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--smoke", action="store_true", help="a tiny model (any device)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = dict(SMOKE_CONFIG) if args.smoke else json.load(open(os.path.join(HERE, "configs", "qwen2.5-0.5b.json")))
    model = build(cfg, dev, dtype)
    base = dict(device=str(dev), dtype=str(dtype).removeprefix("torch."), max_total_tokens=12000,
                chunked_prefill_size=512, max_running_requests=24, cuda_graph_max_bs=16, random_seed=0,
                attention_backend="triton" if dev.type == "cuda" else "torch")
    setups = {"defaults (CUDA graphs on a GPU), overlapped steps": {},
              "steps not overlapped": dict(disable_overlap_schedule=True)}
    if dev.type == "cuda":
        setups["no CUDA graphs"] = dict(disable_cuda_graph=True)
        setups["FP8 KV pool"] = dict(kv_cache_dtype="fp8_e4m3")
    failed = 0
    for label, extra in setups.items():
        try:
            res = run(model, cfg["vocab_size"], args.steps, **dict(base, **extra))
        except Exception as ex:  # the other setups still run
            res = dict(problems=[("engine", repr(ex)[:300])])
        failed += bool(res["problems"])
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in res.items() if k != "problems")
              + f"; problems: {len(res['problems'])} {res['problems'][:5]}", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
