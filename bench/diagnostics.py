"""The suite's diagnostic modes, run instead of the table: GEMV and decode-attention tuning sweeps, kernel
profiles of eager steps, Python's profile of the host side, and sampling under aborts."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time

import torch

from bench.measure import (
    HERE, SMOKE_CONFIG, build, ceilings, decode_step_time, engine_for, in_graph, kernel_time, kv_bytes,
    prefill_steps, print_table, random_prompt, step_phases, sync, timed, weight_bytes)
from engine.engine import Engine
from engine.model import CausalLM
from engine.sampling_params import SamplingParams


def tune_gemv(device, only: str = "") -> None:
    """The one-token GEMV's launch configurations on the 8B and 0.5B projection shapes (those whose name
    contains `only`), bf16 and FP8, timed inside a CUDA graph over enough distinct weight copies (>= 256 MB)
    that nothing is served from L2."""
    from kernels.fp8_linear import FP8
    from kernels.fused import silu_and_mul
    from kernels.gemv import config, gemv, launch_of

    # gate_up with its activation (glu), as the model runs it.
    shapes = {"8B qkv": (6144, 4096, False), "8B o": (4096, 4096, False), "8B gate_up": (28672, 4096, True),
              "8B down": (4096, 14336, False), "0.5B qkv": (1152, 896, False), "0.5B o": (896, 896, False),
              "0.5B gate_up": (9728, 896, True), "0.5B down": (896, 4864, False),
              "8B lm_head": (128256, 4096, False)}

    whole = [(2, 2048, 2, 2), (4, 1024, 2, 2), (4, 2048, 4, 2), (8, 512, 2, 3), (8, 1024, 4, 2),
             (16, 512, 2, 3), (16, 512, 4, 3), (16, 1024, 8, 2), (32, 256, 2, 2), (32, 256, 4, 3),
             (32, 512, 4, 2), (32, 512, 8, 2),
             # One tile per program where K allows: a program loads all its weights before its PDL wait.
             (2, 4096, 2, 1), (4, 4096, 4, 1), (8, 4096, 4, 1), (8, 4096, 8, 1), (16, 4096, 8, 1)]
    # FP8 weights can also split K (the fifth number): tall programs, each over a slice of K ...
    split = [(16, 512, 4, 3, 2), (16, 512, 4, 3, 4), (32, 256, 4, 3, 2), (32, 256, 4, 3, 4), (32, 256, 4, 3, 8),
             (32, 512, 4, 2, 4), (32, 512, 8, 2, 4), (64, 256, 8, 3, 4), (64, 256, 8, 3, 8), (32, 256, 4, 4, 4),
             (8, 4096, 4, 1, 4), (16, 2048, 4, 1, 7), (16, 2048, 8, 1, 7), (8, 2048, 4, 1, 7), (32, 1024, 8, 1, 4),
             # ... or keep two tiles in flight (the sixth).
             (8, 1024, 4, 2, 1, 2), (16, 1024, 8, 2, 1, 2), (8, 512, 4, 2, 1, 2), (4, 1024, 4, 2, 1, 2)]
    bw = ceilings(device, False)["copy_bw"]
    for name, (n, k, glu) in shapes.items():
        if only not in name:
            continue
        for dt in (torch.bfloat16, FP8):
            launches = whole + (split if dt == FP8 else [])
            counters = torch.zeros(n, dtype=torch.int32, device=device)
            size = n * k * (2 if dt == torch.bfloat16 else 1)
            copies = max(1, -(-(256 << 20) // size))
            ws = [torch.randn(n, k, device=device).to(dt) for _ in range(copies)]
            scale = None if dt == torch.bfloat16 else torch.ones(n, device=device)
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            res = []
            # The products against torch's, for every launch (FP8 weights are widened by PTX on the GPU only).
            ref = x.float() @ ws[0].float().t()
            ref = silu_and_mul(ref.to(x.dtype)).float() if glu else ref
            errs = [((gemv(x, ws[0], scale, glu=glu, launch=c, counters=counters).float() - ref).abs().max()
                     / ref.abs().max()).item() for c in launches]
            for launch in launches:
                t = in_graph(lambda: [gemv(x, w, scale, glu=glu, launch=launch, counters=counters) for w in ws],
                             1) / copies
                res.append((size / t / bw, launch))
            res.sort(reverse=True)
            default = launch_of(config(n, k, device, ws[0].element_size(), glu=glu))
            mine = next((r for r, c in res if launch_of(c) == default), float("nan"))
            print(f"  gemv {name} {str(dt).removeprefix('torch.')}: best {res[0][1]} {res[0][0]:.2f} of ceiling, "
                  f"then {res[1][1]} {res[1][0]:.2f}, {res[2][1]} {res[2][0]:.2f}; config() {default} {mine:.2f}; "
                  f"worst error vs torch {max(errs):.1e}",
                  flush=True)
            ws = None  # noqa: F841 (frees the copies before the next shape)


def linear_diagnostics(model: CausalLM, copy_bw: float) -> None:
    """Batch-1 matmuls of one layer and the LM head, timed inside CUDA graphs: share of the copy ceiling for
    bf16 cuBLAS, the Triton GEMV on the bf16 weights, and the FP8 weight-only GEMV on the same shapes
    (gate_up with its activation, as the model runs it; cuBLAS without)."""
    import torch.nn.functional as F

    from kernels.fp8_linear import quantize_per_channel
    from kernels.gemv import config, gemv

    layer = model.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
              "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
              "lm_head": model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight}
    for name, w in shapes.items():
        glu = name == "gate_up"
        x = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype)
        t = in_graph(lambda: F.linear(x, w))
        tg = in_graph(lambda: gemv(x, w, glu=glu))
        line = (f"  linear {name}{' + SiLU' if glu else ''} {tuple(w.shape)}: cuBLAS bf16 {t * 1e6:.1f} us = "
                f"{w.numel() * 2 / t / copy_bw:.2f} of ceiling; triton bf16 {tg * 1e6:.1f} us = "
                f"{w.numel() * 2 / tg / copy_bw:.2f}")
        q, scale = quantize_per_channel(w)
        counters = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)  # for a split K
        t8 = in_graph(lambda: gemv(x, q, scale, glu=glu, counters=counters))
        line += (f"; fp8 {t8 * 1e6:.1f} us = {w.numel() / t8 / copy_bw:.2f} of ceiling, {t / t8:.2f}x cuBLAS "
                 f"(BLOCK_N, BLOCK_K, warps, stages {config(*q.shape, q.device, 1, glu=glu)})")
        q = None  # frees it before the next shape
        print(line, flush=True)


def profile_step(engine: Engine, batch: int, ctx: int) -> None:
    """Kernels of eager decode steps, by total device time."""
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=16 + prefill_steps(engine, batch, ctx), ignore_eos=True)
    reqs = [engine.add_request(random_prompt(ctx, vocab, i), params) for i in range(batch)]
    while any(r.num_output < 2 for r in reqs):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        sync()
    assert not any(r.finished for r in reqs), "every request must run through the profiled steps"
    kernels = sum(e.count for e in prof.key_averages() if getattr(e, "device_type", None) is not None
                  and "CUDA" in str(e.device_type))
    print(f"  device ops per eager step (incl. copies): {kernels / 3:.0f}", flush=True)
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    for r in reqs:
        engine.abort(r.rid)
    while engine.has_work():
        engine.step()


def tune_decode(device, dtype, smoke: bool) -> None:
    """The decode kernel's settings for many requests (TritonBackend.decode_large), timed on one layer's
    pages at batch 64, 2k context (8B shape), then the whole 8B step (CUDA graphs) with the current settings
    and with the fastest, against its roofline. Each setting is timed twice: planned for the batch's own
    context, as an eager step plans it, and for the model's whole context, as a CUDA graph plans it (more
    splits, most of them empty); the fastest is the one with the least time over both."""
    from kernels.attention import create_backend
    from kernels.attention.triton_backend import DecodeLaunch, TritonBackend

    bw = ceilings(device, smoke)["copy_bw"]
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    cfg = dict(SMOKE_CONFIG) if smoke else json.load(open(os.path.join(HERE, "configs", "llama-3.1-8b.json")))
    batch, ctx, steps = (4, 128, 3) if smoke else (64, 2048, 20)
    one = dict(cfg, num_hidden_layers=1)
    e = engine_for(build(one, device, dtype), "triton", batch * (ctx + 64) + 1024, device, dtype, graphs=False)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    reqs = [e.add_request(random_prompt(ctx, cfg["vocab_size"], i), params) for i in range(batch)]
    while any(r.num_output == 0 for r in reqs):
        e.step()
    e.sync()
    _, _, x, _ = e.runner.prepare(e.scheduler.schedule())
    c = e.config
    x_graph = dataclasses.replace(x, max_seq_len=c.max_position_embeddings)
    q = torch.randn(batch, c.num_attention_heads, c.head_dim, device=device, dtype=dtype)
    timer = (lambda fn: timed(fn, 2)) if device.type == "cpu" else kernel_time
    current = TritonBackend.decode_large
    if smoke:  # the small batch would pick decode_small; time the large settings all the same
        TritonBackend.target_programs = 1
    grid = [current] + [DecodeLaunch(bn, w, st, ch, 512, heads_first=hf) for bn in (32, 64, 128) for w in (4, 8)
                        for st in (2, 3, 4) for ch in (512, 1024) for hf in (False, True)]
    grid = list(dict.fromkeys(grid))
    times, flash = {}, None
    try:
        import flashinfer  # noqa: F401

        fi = create_backend("flashinfer", e.pool, c).plan(x)
        flash = timer(lambda: fi.attend(q, 0))
        print(f"flashinfer: {flash * 1e6:.0f} us", flush=True)
    except ImportError:
        pass
    for launch in grid[:3] if smoke else grid:
        TritonBackend.decode_large = launch
        try:
            own, graph = (create_backend("triton", e.pool, c).plan(p) for p in (x, x_graph))
            times[launch] = (timer(lambda: own.attend(q, 0)), timer(lambda: graph.attend(q, 0)))
        except Exception as ex:  # a setting that does not compile or fit
            print(f"{launch}: {ex!r:.80}", flush=True)
            continue
        print(f"{launch}: {times[launch][0] * 1e6:.1f} us ({times[launch][1] * 1e6:.1f} us as a graph plans it)",
              flush=True)
    for r in reqs:
        e.abort(r.rid)
    del e
    best = min(times, key=lambda launch: sum(times[launch]))
    kv_layer = batch * ctx * 2 * c.num_key_value_heads * c.head_dim * torch.empty((), dtype=dtype).element_size()
    big = build(cfg, device, dtype)
    need = (weight_bytes(big) + batch * kv_bytes(big, ctx, dtype)) / bw
    rows = []
    for label, launch in (("current", current), ("fastest", best)):
        TritonBackend.decode_large = launch
        e = engine_for(big, "triton", batch * (ctx + 64) + 4096, device, dtype)
        t = decode_step_time(e, batch, ctx, steps)
        rows.append((label, launch, times[launch], t))
        print(f"{label} {launch}: step {t * 1e3:.2f} ms", flush=True)
        del e
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    TritonBackend.decode_large = current
    peer = "" if flash is None else f"; flashinfer {flash * 1e6:.0f} us ({kv_layer / flash / bw:.2f})"
    print(f"\nattention device time, one layer, batch {batch}, {ctx} ctx (share of {bw / 1e9:.0f} GB/s){peer}")
    print(f"| decode_large | attention us: eager plan; graph plan | batch-{batch} {ctx}-ctx step ms | roofline ms "
          f"| ratio |")
    print("|---|---|---|---|---|")
    for label, launch, (ta, tg), t in rows:
        print(f"| {label} {launch} | {ta * 1e6:.0f} ({kv_layer / ta / bw:.2f}); {tg * 1e6:.0f} ({kv_layer / tg / bw:.2f}) "
              f"| {t * 1e3:.2f} | {need * 1e3:.2f} | {need / t:.3f} |")


def diagnose(device, dtype) -> None:
    """Kernels of eager 8B decode steps by device time, PDL off (a kernel launched with PDL waits inside
    for its predecessor, so its own time would include the wait), at batch 64 / 2k and batch 1 / 1k."""
    big = build(json.load(open(os.path.join(HERE, "configs", "llama-3.1-8b.json"))), device, dtype)
    for pdl_on in ("0", "1"):
        os.environ["PDSERVE_PDL"] = pdl_on
        e = engine_for(big, "triton", 64 * (2048 + 64) + 4096, device, dtype)
        print(f"PDL {pdl_on}: batch-64 step phases, CUDA graph: {step_phases(e, 64, 2048, 10)}", flush=True)
        profile_step(e, 64, 2048)
        del e
        gc.collect()
        torch.cuda.empty_cache()
    os.environ.pop("PDSERVE_PDL")


SAMPLING_MODES = {"greedy": dict(temperature=0), "temperature 1": dict(temperature=1.0),
                  "top-p 0.95": dict(temperature=0.8, top_p=0.95), "top-k 50": dict(temperature=0.8, top_k=50),
                  "min-p 0.05": dict(temperature=0.8, min_p=0.05),
                  "repetition penalty 1.2": dict(temperature=0.8, repetition_penalty=1.2),
                  "logprobs 2": dict(temperature=0.8, logprobs=2)}


def sampling_aborts(device, dtype, smoke: bool) -> None:
    """Sets of seeded requests, one sampling mode each, aborted mid-generation before the next set, at batch 1
    and 8, on the 0.5B shape: through CUDA-graph steps and through eager steps. Prints each set as it ends
    (so a failure names its set; run with CUDA_LAUNCH_BLOCKING=1 to name the kernel), then whether every token
    stayed inside the vocabulary and whether graph steps drew the tokens eager steps drew. That holds where
    both cut the attention's KV alike: at batch 1. A graph plans its attention for the longest context it may
    replay, eager steps for their own, so at batch 8 the splits differ (64 against 16 for 1k tokens) and so
    does the rounding: with random weights, the near-ties that follow make the sets part after some tokens
    (printed, for reading, not checked)."""
    cfg = dict(SMOKE_CONFIG) if smoke else json.load(open(os.path.join(HERE, "configs", "qwen2.5-0.5b.json")))
    model = build(cfg, device, dtype)
    ctx, new = (64, 12) if smoke else (1024, 33)
    outs = {}
    for graphs in (True, False):
        e = engine_for(model, "triton" if device.type == "cuda" else "torch", 16384, device, dtype, graphs=graphs)
        outs[graphs] = []
        for batch in (1, 8):
            for rnd in range(3):
                for name, fields in SAMPLING_MODES.items():
                    reqs = [e.add_request(random_prompt(ctx, cfg["vocab_size"], 100 * rnd + i), SamplingParams(
                        seed=1000 * rnd + i, max_tokens=new + 8, ignore_eos=True, **fields)) for i in range(batch)]
                    while any(r.num_output < new for r in reqs):
                        e.step()
                    e.sync()
                    ids = [list(r.output_ids) for r in reqs]
                    ok = all(0 <= t < cfg["vocab_size"] for o in ids for t in o)
                    print(f"  graphs={graphs} batch {batch} round {rnd} {name}: {'ok' if ok else 'TOKEN OUT OF RANGE'}",
                          flush=True)
                    outs[graphs].append((batch, name, ok, ids))
                    for r in reqs:
                        e.abort(r.rid)
        del e
        gc.collect()
    rows = []
    inside = sum(ok for g in outs.values() for _, _, ok, _ in g)
    rows.append(("sets whose tokens all lie inside the vocabulary, graph and eager steps", inside,
                 sum(len(g) for g in outs.values()), inside / sum(len(g) for g in outs.values()), "== 1 (check)"))
    for batch in (1, 8):
        pairs = [(a, b) for a, b in zip(outs[True], outs[False]) if a[0] == batch]
        same = sum(a[3] == b[3] for a, b in pairs)
        for (_, name, _, ga), (_, _, _, ea) in pairs:
            if ga != ea:
                first = [next((j for j, (x, y) in enumerate(zip(g, q)) if x != y), None) for g, q in zip(ga, ea)]
                print(f"  batch {batch} {name}: graph and eager part at tokens {first}", flush=True)
        rows.append((f"batch {batch}: seeded sets through CUDA-graph steps equal to eager steps", same, len(pairs),
                     same / len(pairs), "== 1 (check)" if batch == 1 else "(for reading: other splits)"))
    print_table(rows)


def profile_host(device, dtype, smoke: bool) -> None:
    """Where the host's time goes in eager steps (no CUDA graph): Python's profile of 8B batch-1 decode steps
    and of 128-token prefills, by own time. An eager step takes several times its device time, and prefill
    steps of short prompts and decode batches above the largest graph run eagerly."""
    import cProfile
    import pstats

    cfg = dict(SMOKE_CONFIG) if smoke else json.load(open(os.path.join(HERE, "configs", "llama-3.1-8b.json")))
    model = build(cfg, device, dtype)
    e = engine_for(model, "triton" if device.type == "cuda" else "torch", 8192, device, dtype, graphs=False)
    vocab = model.config.vocab_size
    for label, prompt, new, steps in (("decode, batch 1, 1024 ctx", 1024, 64, 20), ("prefill of 128 tokens", 128, 1, 10)):
        prof = cProfile.Profile()
        times = []
        for i in range(steps + 2):
            r = e.add_request(random_prompt(prompt, vocab, i), SamplingParams(temperature=0, max_tokens=new,
                                                                              ignore_eos=True))
            if new > 1:  # decode: prefill first, then profile the decode steps
                while r.num_output < 2:
                    e.step()
            sync()
            t0 = time.perf_counter()
            if i >= 2:
                prof.enable()
            e.step()
            sync()
            if i >= 2:
                prof.disable()
                times.append(time.perf_counter() - t0)
            e.abort(r.rid)
            while e.has_work():
                e.step()
        print(f"{label}: eager step ms, median of {steps}: {statistics.median(times) * 1e3:.2f}", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
