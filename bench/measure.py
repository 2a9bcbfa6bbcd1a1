"""What the GPU suite measures with: ceilings, random-weight engines of real shapes, step and kernel times,
and the table it prints. Every time is taken on the device the engine runs on."""

from __future__ import annotations

import os
import statistics
import time

import torch

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.engine import Engine
from engine.loader import build_model
from engine.model import CausalLM
from engine.sampling_params import SamplingParams


HERE = os.path.dirname(os.path.abspath(__file__))


# Head size 64: the smallest every attention backend runs (FlashInfer's kernels are built for 64, 128, 256).
SMOKE_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
                "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 16384}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int, warmup: int = 2) -> float:
    """Median seconds of fn() over iters runs (synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def in_graph(fn, n: int = 20) -> float:
    """Seconds per call of fn, captured n times in a CUDA graph and replayed: device time without the
    launch overhead that a Python-launched microsecond kernel would otherwise show."""
    fn()
    sync()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(n):
            fn()
    g.replay()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    sync()
    return start.elapsed_time(end) / 1e3 / (5 * n)


def kernel_time(fn, iters: int = 20) -> float:
    """Seconds of device time per call of fn: the durations of the kernels it launches, as the profiler
    records them. Unlike a host or event timing of calls launched from Python, this does not grow when the
    launches cost more than the kernels run (Triton launches cost tens of microseconds on the H200 host)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        sync()
    total_us = 0.0
    for e in prof.key_averages():
        if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            total_us += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    if total_us <= 0:
        raise RuntimeError("the profiler recorded no kernels")
    return total_us / 1e6 / iters


def ceilings(device, smoke: bool) -> dict:
    n = (1 << 20) if smoke else (1 << 30)  # bf16 elements: 2 GiB on the GPU
    x = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), 5 if smoke else 20)
    m = 256 if smoke else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    tm = timed(lambda: a @ b, 5 if smoke else 20)
    return {"copy_bw": 2 * x.numel() * 2 / t, "matmul": 2 * m ** 3 / tm}


def build(cfg: dict, device, dtype) -> CausalLM:
    """Random weights of a real shape, initialised as for training (engine.loader.random_init)."""
    return build_model(ModelConfig.from_hf_dict(cfg), dtype, device)


def engine_for(model, backend: str, tokens: int | None, device, dtype, chunk=8192, graphs=True,
               kv="auto", mem_fraction=None, quantization=None, layout="NHD", lm_head=False) -> Engine:
    args = EngineArgs(device=str(device), dtype=str(dtype).removeprefix("torch."), attention_backend=backend,
                      max_total_tokens=tokens, chunked_prefill_size=chunk, max_running_requests=256,
                      disable_radix_cache=True, disable_cuda_graph=not graphs, cuda_graph_max_bs=64,
                      kv_cache_dtype=kv, mem_fraction_static=mem_fraction,
                      quantization=quantization, quantize_lm_head=lm_head, kv_layout=layout)
    return Engine(args, model=model)


def weight_bytes(model: CausalLM) -> int:
    """Bytes read per decode step: every weight once, except the embedding table (one row per token),
    which is read whole only when it doubles as the LM head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def kv_bytes(model: CausalLM, tokens: int, dtype) -> int:
    c = model.config
    return tokens * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * torch.empty((), dtype=dtype).element_size()


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def prefill_steps(engine: Engine, batch: int, ctx: int) -> int:
    """Steps until the last of `batch` prompts of `ctx` tokens is prefilled. The first requests decode all
    the while, so their token budget must cover these steps too, or they finish while the batch is timed."""
    return -(-batch * ctx // (engine.args.chunked_prefill_size or 8192)) + 2


def decode_step_time(engine: Engine, batch: int, ctx: int, steps: int, synced: bool = False,
                     sampling: dict | None = None) -> float:
    """Seconds per decode step with `batch` requests at about `ctx` tokens of context, in steady state: steps
    called back to back, as a server runs them, so that each step's host work (scheduling, page tables)
    overlaps the device work of the step before (Engine.step). synced=True: the median of steps each
    started on an idle device and waited for, which adds the host work of every step to its time.
    `sampling`: SamplingParams fields for the requests (greedy without), a seed given per request."""
    vocab = engine.config.vocab_size
    fields = dict(temperature=0, max_tokens=steps + 8 + prefill_steps(engine, batch, ctx), ignore_eos=True)
    fields.update(sampling or {})
    reqs = [engine.add_request(random_prompt(ctx, vocab, i), SamplingParams(**dict(fields, seed=i)))
            for i in range(batch)]
    while any(r.num_output == 0 for r in reqs):  # prefill all
        engine.step()
    if synced:
        t = timed(engine.step, steps, warmup=2)
    else:
        for _ in range(2):
            engine.step()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        engine.sync()
        t = (time.perf_counter() - start) / steps
    assert not any(r.finished for r in reqs), "every request must run through the timed steps"
    for r in reqs:
        engine.abort(r.rid)
    return t


def greedy_tokens(engine: Engine, ctx: int, n: int) -> list[int]:
    vocab = engine.config.vocab_size
    req = engine.add_request(random_prompt(ctx, vocab, 99), SamplingParams(temperature=0, max_tokens=n,
                                                                           ignore_eos=True))
    while engine.has_work():
        engine.step()
    return req.output_ids


def prefill_time(engine: Engine, n: int) -> float:
    vocab = engine.config.vocab_size

    def once():
        r = engine.add_request(random_prompt(n, vocab, 99), SamplingParams(temperature=0, max_tokens=1))
        while engine.has_work():
            engine.step()
        assert r.finish_reason == "length"

    return timed(once, 3, warmup=1)


def prefill_flops(model: CausalLM, n: int) -> float:
    c = model.config
    dense = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if c.tie_word_embeddings:
        dense += model.embed_tokens.weight.numel()
    # Causal attention: QK^T and PV each 2 * n^2 / 2 * heads * head_dim multiply-adds' worth of FLOPs.
    attn = 2 * c.num_hidden_layers * n * n * c.num_attention_heads * c.head_dim
    return 2 * dense * n + attn


def step_phases(engine: Engine, batch: int, ctx: int, steps: int) -> dict:
    """Where a decode step's time goes: host phases, and the forward alone (graph replay or eager)."""
    vocab = engine.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps * 4 + 8 + prefill_steps(engine, batch, ctx),
                            ignore_eos=True)
    reqs = [engine.add_request(random_prompt(ctx, vocab, i), params) for i in range(batch)]
    while any(r.num_output == 0 for r in reqs):
        engine.step()
    sched = engine.scheduler
    r = engine.runner
    out = {}
    for _ in range(2):
        engine.step()
    engine.sync()  # the phases are timed one by one, on a step whose inputs are all on the host
    chunks = sched.schedule()
    out["prepare_ms"] = timed(lambda: r.prepare(chunks), steps) * 1e3
    out["forward_ms"] = timed(lambda: r.forward(chunks), steps) * 1e3
    logits = r.forward(chunks)
    out["sample_ms"] = timed(lambda: r.sample(logits, [c.req for c in chunks]).tokens.tolist(), steps) * 1e3
    out["step_ms"] = timed(engine.step, steps) * 1e3
    for q in reqs:
        engine.abort(q.rid)
    return out


def attention_times(engine: Engine, names: list[str], batch: int, ctx: int, iters: int) -> dict[str, float]:
    """Seconds of one layer's attention (KV store included) for a decode batch, per backend, same pages:
    kernel time on a GPU (kernel_time), wall time elsewhere."""
    from kernels.attention import create_backend

    vocab = engine.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # none finishes meanwhile
    reqs = [engine.add_request(random_prompt(ctx, vocab, i), params) for i in range(batch)]
    while any(r.num_output == 0 for r in reqs):
        engine.step()
    engine.sync()
    chunks = engine.scheduler.schedule()
    assert len(chunks) == batch and all(c.length == 1 for c in chunks)
    _, _, x, _ = engine.runner.prepare(chunks)
    c = engine.config
    dev, dt = engine.pool.device, engine.pool.dtype
    q = torch.randn(batch, c.num_attention_heads, c.head_dim, device=dev, dtype=dt)
    k = torch.randn(batch, c.num_key_value_heads, c.head_dim, device=dev, dtype=dt)
    v = torch.randn(batch, c.num_key_value_heads, c.head_dim, device=dev, dtype=dt)
    out = {}
    for name in names:
        step = create_backend(name, engine.pool, c).plan(x)
        fn = lambda: step.forward(q, k, v, 0)  # noqa: E731
        out[name] = kernel_time(fn, iters) if dev.type == "cuda" else timed(fn, iters)
    for r in reqs:
        engine.abort(r.rid)
    return out


def print_table(rows: list) -> None:
    print()
    print("| figure | value | ceiling / peer | ratio | target |")
    print("|---|---|---|---|---|")
    for label, value, ref, ratio, target in rows:
        fmt = lambda v: "" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
        print(f"| {label} | {fmt(value)} | {fmt(ref)} | {fmt(ratio)} | {target} |")
