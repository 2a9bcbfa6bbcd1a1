"""GPU benchmark suite: one command, one table of figures against ceilings measured in the same run.

    python -m bench.gpu                      # on a GPU: the engine rows (about three minutes on an H200)
    python -m bench.gpu --pd-tokenizer DIR   # and the service rows: 1P1D vs colocated `pdserve up` (bench/pd.py)
    python -m bench.gpu --smoke              # tiny shapes, any device: checks that the suite runs

Models are random-weight builds of real shapes (bench/configs/). Ceilings: device copy bandwidth (bytes read
+ written per second) and the bf16 matmul rate, both measured here first. Each row prints the figure, its
ceiling or peer, the ratio and the target. Diagnostics print before the table: matmuls timed inside CUDA
graphs, a profile of eager decode steps, the page-copy sweep of the cuda_ipc row.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
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
SMOKE_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
                "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
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


def draw_rows(rows: list, device, smoke: bool) -> None:
    """The draw kernel a decode graph ends in, on the device: its tokens against the sampler's torch formula
    computed on the same device (random rows, temperatures, 64-bit seeds and draw indices), and rows where one
    token stands 30 above zeros and -inf (half the vocabulary, as truncation leaves it) must all draw it. The
    second failed about one row in eighty while the noise could round to u = 1 (engine.sampler.unit_interval)."""
    from engine.sampler import draw, uniform_noise, argmax_rows

    vocab, n, batches = (1000, 64, 2) if smoke else (151936, 256, 16)
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(n, vocab, device=device, generator=g) * 4
    temp = torch.rand(n, device=device, generator=g) * 1.5
    temp[::7] = 0
    seeds = torch.randint(-2**62, 2**62, (n,), device=device, generator=g)
    steps = torch.randint(0, 5000, (n,), device=device, generator=g)
    got = draw(logits, temp, seeds, steps)
    t = torch.where(temp > 0, temp, torch.ones_like(temp))
    score = logits / t[:, None] - torch.log(-torch.log(uniform_noise(seeds, steps, vocab)))
    same = int((got == argmax_rows(torch.where((temp > 0)[:, None], score, logits))).sum())
    rows.append((f"device draw against the sampler's torch formula, {n} rows of {vocab} tokens: rows equal", same, n,
                 same / n, "== 1 (check)"))
    kept = 0
    peaked = torch.zeros(n, vocab, device=device)
    peaked[:, 1::2] = float("-inf")
    peaked[:, 10] = 30.0
    for i in range(batches):
        rs = torch.arange(i * n, (i + 1) * n, device=device)
        kept += int((draw(peaked, torch.ones(n, device=device), rs, torch.zeros_like(rs)) == 10).sum())
    rows.append((f"draws at T 1 from rows where one token stands 30 above zeros and -inf, {batches * n} seeds: "
                 f"rows drawing it", kept, batches * n, kept / (batches * n), "== 1 (check)"))
    print(rows[-2:], flush=True)


def sampled_rows(engine: Engine, label: str, t_greedy: float, rows: list, ctx: int, steps: int) -> None:
    """Batch-1 steps that sample, against the greedy step: a temperature alone is drawn inside the decode
    graph; top-p takes the sampler after it."""
    for name, fields in (("temperature 1", dict(temperature=1.0)),
                         ("temperature 0.8, top-p 0.95", dict(temperature=0.8, top_p=0.95))):
        t = decode_step_time(engine, 1, ctx, steps, sampling=fields)
        rows.append((f"{label} batch-1 decode, {ctx} ctx, sampled at {name}: step ms (greedy ms)", t * 1e3,
                     t_greedy * 1e3, t_greedy / t, "(for comparison)"))
        print(rows[-1], flush=True)


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


IPC_LAYOUT = dict(num_layers=32, page_size=16, kv_heads=8, head_dim=128)  # the 8B shape


def kv_bytes_per_token_8b() -> int:
    return IPC_LAYOUT["num_layers"] * 2 * IPC_LAYOUT["kv_heads"] * IPC_LAYOUT["head_dim"] * 2


def _ipc_receiver(to_parent, from_parent, num_pages: int) -> None:
    """The decode side of the cuda_ipc row, in its own process: export a pool, await pages, checksum them."""
    from kvstore import KVPool
    from transfer.cuda_ipc import CudaIpcTransfer

    pool = KVPool(num_pages, dtype=torch.bfloat16, device="cuda", **IPC_LAYOUT)
    t = CudaIpcTransfer(pool, "decode", "127.0.0.1")
    to_parent.put(t.endpoint())
    dst, rounds = from_parent.get()
    got = 0
    deadline = time.time() + 120
    while got < rounds and time.time() < deadline:
        got += len(t.poll_received())
        time.sleep(0.001)
    idx = torch.tensor(dst, device="cuda")
    to_parent.put((got, pool.data.index_select(1, idx).view(torch.int16).to(torch.int64).sum().item()))


def cuda_ipc_row(tokens: int = 4096) -> tuple[float, float, bool]:
    """(ms to move a request's scattered pages into another process's pool, ms of a contiguous device
    copy of the same bytes, bit-exact?)."""
    import multiprocessing as mp

    from kvstore import KVPool
    from transfer.cuda_ipc import CudaIpcTransfer

    n, pages = tokens // IPC_LAYOUT["page_size"], 1024
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_receiver, args=(to_parent, from_parent, pages))
    child.start()
    endpoint = to_parent.get(timeout=120)
    pool = KVPool(pages, dtype=torch.bfloat16, device="cuda", **IPC_LAYOUT)
    pool.data.normal_()
    g = torch.Generator().manual_seed(0)
    src = (torch.randperm(pages - 1, generator=g)[:n] + 1).tolist()
    dst = (torch.randperm(pages - 1, generator=g)[:n] + 1).tolist()
    rounds = 21
    from_parent.put((dst, rounds))
    t = CudaIpcTransfer(pool, "prefill", "127.0.0.1")
    remote, _ = t._peer("decode", endpoint)
    src_t = torch.tensor(src, dtype=torch.int32, device="cuda")
    dst_t = torch.tensor(dst, dtype=torch.int32, device="cuda")
    import kernels.page_copy as pc

    best, default = None, (pc.CHUNK, pc.WARPS)
    for chunk in (2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            pc.CHUNK, pc.WARPS = chunk, warps
            # Device time, in a graph as a send runs it: a launch's host time would blur 10 us differences.
            k = in_graph(lambda: pc.copy_pages(pool.data, remote, src_t, dst_t), 10)
            print(f"  page copy into the mapped pool, chunk {chunk} warps {warps}: {k * 1e3:.3f} ms", flush=True)
            if best is None or k < best[0]:
                best = (k, chunk, warps)
    pc.CHUNK, pc.WARPS = default  # the sends below run as a worker runs them
    # The same kernel into a second pool of this process: what the IPC mapping itself costs, if anything.
    local = torch.empty_like(pool.data)
    k_local = in_graph(lambda: pc.copy_pages(pool.data, local, src_t, dst_t), 10)
    k_remote = in_graph(lambda: pc.copy_pages(pool.data, remote, src_t, dst_t), 10)
    print(f"  page copy, default setting: into a pool of this process {k_local * 1e3:.3f} ms, into the mapped "
          f"pool {k_remote * 1e3:.3f} ms", flush=True)
    local = None  # noqa: F841 (frees the 2 GB before the sends)
    times, device_times = [], []
    for i in range(rounds):
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        t.send(f"r{i}", "decode", endpoint, src, dst, b"ready")
        end.record()
        sync()
        times.append(time.perf_counter() - t0)
        device_times.append(start.elapsed_time(end) / 1e3)
        while not t.poll_sent():
            time.sleep(0.001)
    got, checksum = to_parent.get(timeout=120)
    child.join(timeout=60)
    expect = pool.data.index_select(1, torch.tensor(src, device="cuda")).view(torch.int16).to(torch.int64).sum().item()
    nbytes = n * pool.page_bytes
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    copy = timed(lambda: b.copy_(a), 20)
    t.close()
    # Where the host time of a send goes (each phase as send() does it, median of 5).
    phases = {"pinned buffer + fill": [], "async copy of the lists": [], "page-copy launch": [], "event": []}
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        host = torch.empty(2 * n, dtype=torch.int32, pin_memory=True)
        host.numpy()[:n] = src
        host.numpy()[n:] = dst
        t1 = time.perf_counter()
        lists = host.to("cuda", non_blocking=True)
        t2 = time.perf_counter()
        pc.copy_pages(pool.data, remote, lists[:n], lists[n:])
        t3 = time.perf_counter()
        torch.cuda.Event().record()
        t4 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k].append(v)
        sync()
    print("  cuda_ipc send, host us per phase: " +
          ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in phases.items()), flush=True)
    print(f"  cuda_ipc: best chunk {best[1]} warps {best[2]}, kernel alone {best[0] * 1e3:.3f} ms (default "
          f"{default}); send() "
          f"host wall ms {[round(x * 1e3, 3) for x in times]}, device ms {[round(x * 1e3, 3) for x in device_times]}",
          flush=True)
    return statistics.median(times[1:]), statistics.median(device_times[1:]), copy, got == rounds and checksum == expect


def _transfer_receiver(backend: str, to_parent, from_parent, num_pages: int) -> None:
    """The decode side of a transfer row, in its own process: a GPU pool behind `backend`; await `rounds`
    requests' pages, then checksum them."""
    from kvstore import KVPool
    from transfer import create_transfer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pool = KVPool(num_pages, dtype=torch.bfloat16, device=dev, **IPC_LAYOUT)
    t = create_transfer(backend, pool, "decode", "127.0.0.1")
    to_parent.put(t.endpoint())
    dst, rounds = from_parent.get()
    for i in range(rounds):
        t.expect(f"r{i}", dst)
    got = 0
    deadline = time.time() + 120
    while got < rounds and time.time() < deadline:
        got += len(t.poll_received())
        time.sleep(0.001)
    idx = torch.tensor(dst, device=dev)
    to_parent.put((got, pool.data.index_select(1, idx).view(torch.int16).to(torch.int64).sum().item()))
    t.close()


def transfer_row(backend: str, tokens: int) -> tuple[float, bool]:
    """(seconds per send of `tokens` tokens of 8B KV, scattered pages, GPU to GPU between two processes,
    until the sender sees it complete; bit-exact at the receiver?) through a transfer engine (nixl, tcp)."""
    import multiprocessing as mp

    from engine.protocol import KVReady, encode
    from kvstore import KVPool
    from transfer import create_transfer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n, pages, rounds = tokens // IPC_LAYOUT["page_size"], 2 * tokens // IPC_LAYOUT["page_size"] + 1, 4
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_transfer_receiver, args=(backend, to_parent, from_parent, pages))
    child.start()
    endpoint = to_parent.get(timeout=120)
    pool = KVPool(pages, dtype=torch.bfloat16, device=dev, **IPC_LAYOUT)
    pool.data.normal_()
    g = torch.Generator().manual_seed(1)
    src = (torch.randperm(pages - 1, generator=g)[:n] + 1).tolist()
    dst = (torch.randperm(pages - 1, generator=g)[:n] + 1).tolist()
    from_parent.put((dst, rounds))
    t = create_transfer(backend, pool, "prefill", "127.0.0.1")
    times, ok = [], True
    for i in range(rounds):
        sync()
        t0 = time.perf_counter()
        t.send(f"r{i}", "decode", endpoint, src, dst, encode(KVReady(f"r{i}", 0)))
        done = []
        while not done and time.perf_counter() - t0 < 60:
            done = t.poll_sent()
            time.sleep(0.0002)
        times.append(time.perf_counter() - t0)
        ok = ok and bool(done) and done[0].ok
    got, checksum = to_parent.get(timeout=180)
    child.join(timeout=60)
    t.close()
    expect = pool.data.index_select(1, torch.tensor(src, device=dev)).view(torch.int16).to(torch.int64).sum().item()
    return statistics.median(times[1:]), ok and got == rounds and checksum == expect


def record_logits(engine: Engine) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    inner = engine.runner.sample

    def sample(logits, reqs):
        seen.append(logits.float().clone())
        return inner(logits, reqs)

    engine.runner.sample = sample
    return seen


def record_rows(engine: Engine) -> tuple[dict, dict]:
    """Logits rows by (request index, output position): what each request's next token is drawn from. The
    caller fills `order` (request id -> index) as it adds requests."""
    rows: dict = {}
    order: dict[str, int] = {}
    inner = engine.runner.sample

    def sample(logits, reqs):
        for i, r in enumerate(reqs):
            rows[(order[r.rid], r.num_output + r.pending)] = logits[i].float().clone()
        return inner(logits, reqs)

    engine.runner.sample = sample
    return rows, order


def correctness(model, backends, device, dtype) -> dict:
    """Each backend's logits against torch's on the same mixed batches: decodes plus new prefill chunks.
    A row is compared only where both runs fed the request the same tokens (greedy choices can differ at
    near-ties, after which the two runs compute different sequences)."""
    vocab = model.config.vocab_size
    runs, outs = {}, {}
    names = ["torch"] + backends + [b + "-eager" for b in backends if b == "triton"]
    if device.type == "cuda":
        names.append("torch-fp32")  # the yardstick for every bf16 backend
    for name in names:
        m = copy.deepcopy(model).float() if name == "torch-fp32" else model
        e = engine_for(m, name.split("-")[0], 16384, device, torch.float32 if name == "torch-fp32" else dtype,
                       chunk=1024, graphs=not name.endswith("-eager"))
        rows, order = record_rows(e)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        reqs = []
        for i in range(4):
            reqs.append(e.add_request(random_prompt(200 + 50 * i, vocab, i), params))
            order[reqs[-1].rid] = i
        e.step()  # prefill of the first four
        for i in range(4, 7):  # new prompts join running decodes: mixed batches
            reqs.append(e.add_request(random_prompt(300 + 70 * i, vocab, i), params))
            order[reqs[-1].rid] = i
        while e.has_work():
            e.step()
        e.check()
        runs[name], outs[name] = rows, [r.output_ids for r in reqs]
        e.runner.sample = None  # break the engine <-> recorder cycle so its memory goes now
        del e, m, reqs
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    out = {}
    for name in runs:
        for ref in ("torch", "torch-fp32"):
            if name == ref or ref not in runs or name == "torch-fp32":
                continue
            keys = [k for k in runs[ref] if k in runs[name] and outs[name][k[0]][: k[1]] == outs[ref][k[0]][: k[1]]]
            a = torch.stack([runs[name][k] for k in keys])
            b = torch.stack([runs[ref][k] for k in keys])
            err = ((a - b).abs().amax(dim=1) / b.abs().amax(dim=1)).max().item()
            norm = ((a - b).norm(dim=1) / b.norm(dim=1)).max().item()
            print(f"  {name} vs {ref}: {len(keys)} of {len(runs[ref])} rows with equal inputs; worst row: "
                  f"max-based {err:.2e}, norm-based {norm:.2e}", flush=True)
            if ref == "torch":
                out[name] = (err, norm)
    return out


def fp8_kv(model, backend: str, device, dtype) -> tuple[float, float]:
    """(token capacity of an FP8 pool / a bf16 pool in the same memory, max rel. error of first-token
    logits with FP8 KV against bf16 KV on the same prompts)."""
    caps = {}
    gc.collect()
    for kv in ("auto", "fp8_e4m3"):
        torch.cuda.empty_cache()  # memory cached by earlier runs would count as used
        e = engine_for(model, backend, None, device, dtype, graphs=False, kv=kv, mem_fraction=0.3)
        caps[kv] = e.pool.max_total_num_tokens
        del e
        torch.cuda.empty_cache()
    logits = {}
    vocab = model.config.vocab_size
    for kv in ("auto", "fp8_e4m3"):
        e = engine_for(model, backend, 16384, device, dtype, graphs=False, kv=kv)
        seen = record_logits(e)
        for i in range(6):
            e.add_request(random_prompt(100 + 150 * i, vocab, i), SamplingParams(temperature=0, max_tokens=1))
        while e.has_work():
            e.step()
        logits[kv] = torch.cat(seen)
        del e
    err = ((logits["fp8_e4m3"] - logits["auto"]).abs().max() / logits["auto"].abs().max()).item()
    return caps["fp8_e4m3"] / caps["auto"], err


def fp8_kv_decode(model, backend: str, device, dtype, ctx: int, steps: int) -> tuple[float, float]:
    """(batch-1 decode step seconds with an FP8 KV pool, with a bf16 one), CUDA graphs on: the decode kernels'
    FP8 path as a server runs it (the rows above only prefill)."""
    times = {}
    for kv in ("fp8_e4m3", "auto"):
        e = engine_for(model, backend, 16384, device, dtype, kv=kv)
        times[kv] = decode_step_time(e, 1, ctx, steps)
        del e
        gc.collect()
    return times["fp8_e4m3"], times["auto"]


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


def greedy_tokens(engine: Engine, ctx: int, n: int) -> list[int]:
    vocab = engine.config.vocab_size
    req = engine.add_request(random_prompt(ctx, vocab, 99), SamplingParams(temperature=0, max_tokens=n,
                                                                           ignore_eos=True))
    while engine.has_work():
        engine.step()
    return req.output_ids


def graph_vs_eager(model, backend: str, device, dtype, ctx: int, n: int = 32) -> tuple[int, int]:
    """(prompts whose greedy tokens agree, prompts): the same requests through CUDA-graph decode steps and
    through eager ones. Eight prompts decode together, then one alone: batches of a graph's own size, so that
    both paths run the same products (a padded batch is a larger matrix product, which may round otherwise and
    flip a near-tie of these random models; the logits rows cover padded graphs). A graph's attention is
    planned for its longest context (more, shorter KV splits, summed in another order), so the eager steps
    are planned the same way here: then the two paths agree to the bit, and a difference is a wrong input.
    The graph path has inputs of its own (static buffers filled by two copies, engine/graph.py) that the other
    greedy rows cannot check: they compare two graph runs."""
    outs = []
    max_context = None
    for graphs in (True, False):
        e = engine_for(model, backend, 9 * (ctx + n + 64), device, dtype, graphs=graphs)
        if graphs:
            max_context = e.runner.graphs.max_context
        else:
            plan = e.runner.backend.plan
            e.runner.backend.plan = lambda x: plan(dataclasses.replace(x, max_seq_len=max_context)
                                                   if x.is_decode else x)
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        batch = [e.add_request(random_prompt(ctx + 7 * i, model.config.vocab_size, 50 + i), params) for i in range(8)]
        while e.has_work():
            e.step()
        alone = e.add_request(random_prompt(ctx, model.config.vocab_size, 60), params)
        while e.has_work():
            e.step()
        outs.append([r.output_ids for r in batch + [alone]])
        del e
        gc.collect()
    return sum(a == b for a, b in zip(*outs)), len(outs[0])


# Batch-1 variants of the default step: environment variable -> (its value, what that does). The fusions off
# by default are timed on, those on by default off, so that each run shows what every choice is worth.
EXPERIMENTS = {"PDSERVE_FOLD_NORMS": ("1", "norms folded into the GEMV"),
               "PDSERVE_FUSE_ROPE": ("0", "rope in its own kernel after the qkv GEMV (the default fuses them)")}
# Models as narrow as CausalLM.fold_max_width fold the norms by default: their variant unfolds them.
NARROW_EXPERIMENTS = {"PDSERVE_FOLD_NORMS": ("0", "norms in kernels of their own (the default folds them at this width)"),
                      "PDSERVE_NORM_SQUARES": ("0", "folded norms gather the sum of squares in their own GEMV "
                                                    "(the default takes it from the residual add's)"),
                      "PDSERVE_NORM_TOKEN": ("0", "folded norms multiply by their weight in the K loop (by default "
                                                  "the residual add before leaves the token times it)"),
                      "PDSERVE_FUSE_ROPE": EXPERIMENTS["PDSERVE_FUSE_ROPE"]}


def variant_rows(engine: Engine, model, label: str, t_default: float, rows: list, ctx: int, steps: int,
                 experiments: dict[str, tuple[str, str]] = EXPERIMENTS, rounds: int = 3) -> None:
    """The batch-1 step with each variant, against `engine`, the default: the median step time of `rounds`
    measurements taken in turn with the default's (so that drift of the machine between them falls on
    both), and whether 32 greedy tokens agree with the default's."""
    base = greedy_tokens(engine, ctx, 32)

    def switch(var: str, value: str | None) -> None:
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value

    for var, (value, what) in experiments.items():
        name = f"{what} ({var}={value})"
        t_var, t_def = [], [t_default]
        try:
            switch(var, value)  # read when the engine captures its graphs, and by any eager step
            e = engine_for(model, engine.args.attention_backend, 8192, engine.pool.device, engine.pool.dtype)
            for i in range(rounds):
                switch(var, value)
                t_var.append(decode_step_time(e, 1, ctx, steps))
                switch(var, None)
                if i:
                    t_def.append(decode_step_time(engine, 1, ctx, steps))
            switch(var, value)
            same = greedy_tokens(e, ctx, 32) == base
            del e
        except Exception as ex:  # an experiment must not take the rest of the suite down with it
            rows.append((f"{label} batch-1 decode, {ctx} ctx, {name}", None, None, None, f"failed: {ex!r:.120}"))
            print(rows[-1], flush=True)
            continue
        finally:
            switch(var, None)
            gc.collect()
        tv, td = statistics.median(t_var), statistics.median(t_def)
        print(f"  {label} {var}={value}: step ms {[round(t * 1e3, 3) for t in t_var]}, default "
              f"{[round(t * 1e3, 3) for t in t_def]}", flush=True)
        rows.append((f"{label} batch-1 decode, {ctx} ctx, {name}: step ms (default ms), medians of {rounds} taken in "
                     f"turn; 32 greedy tokens as the default's: {same}", tv * 1e3, td * 1e3, td / tv,
                     "(for comparison)"))
        print(rows[-1], flush=True)


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


def transfer_rows(rows: list) -> None:
    """KV transfer between two processes on this GPU: cuda_ipc against a contiguous copy, then nixl and tcp."""
    from transfer import available_backends

    t, td, copy, exact = cuda_ipc_row()
    rows.append((f"cuda_ipc, 4096 tokens of 8B KV, scattered, into another process: device ms of the send "
                 f"(copy ms); exact={exact}", td * 1e3, copy * 1e3, td / copy, "<= 1.25"))
    rows.append(("cuda_ipc, the same: host wall ms of send() until the pages are in place (copy ms)", t * 1e3,
                 copy * 1e3, t / copy, "(for comparison)"))
    print(rows[-2:], flush=True)
    for backend in [b for b in ("nixl", "tcp") if b in available_backends(on_gpu=True)]:
        tokens = 1024
        try:
            t, exact = transfer_row(backend, tokens)
            nbytes = tokens * kv_bytes_per_token_8b()
            rows.append((f"{backend}, {tokens} tokens of 8B KV, scattered, GPU to GPU between processes: ms per "
                         f"send (GB/s); exact={exact}", t * 1e3, nbytes / t / 1e9, None, "(for comparison)"))
        except Exception as ex:
            rows.append((f"{backend} transfer between processes on the GPU", None, None, None,
                         f"failed: {ex!r:.120}"))
        print(rows[-1], flush=True)


def print_table(rows: list) -> None:
    print()
    print("| figure | value | ceiling / peer | ratio | target |")
    print("|---|---|---|---|---|")
    for label, value, ref, ratio, target in rows:
        fmt = lambda v: "" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
        print(f"| {label} | {fmt(value)} | {fmt(ref)} | {fmt(ratio)} | {target} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, seconds, any device")
    ap.add_argument("--tune-decode", action="store_true",
                    help="the decode kernel's settings for large batches, each planned as an eager step and as a "
                         "CUDA graph plans it, and the batch-64 step with the fastest")
    ap.add_argument("--diagnose", action="store_true", help="kernel profiles of eager 8B decode steps")
    ap.add_argument("--profile-host", action="store_true", help="Python's profile of eager decode and prefill steps")
    ap.add_argument("--only-transfers", action="store_true", help="only the KV transfer rows (cuda_ipc, nixl, tcp)")
    ap.add_argument("--sampling-aborts", action="store_true",
                    help="sets of requests in every sampling mode, aborted mid-generation: graph steps vs eager")
    ap.add_argument("--tune-gemv", nargs="?", const="", default=None, metavar="SHAPE",
                    help="time the one-token GEMV's launch configurations (on the shapes whose name contains SHAPE)")
    ap.add_argument("--pd-tokenizer", default=None,
                    help="a directory with tokenizer.json: also run the 1P1D service rows (bench/pd.py)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = ["triton"] if device.type == "cuda" else []
    try:
        import flashinfer  # noqa: F401

        backends += ["flashinfer"] if device.type == "cuda" else []
    except ImportError:
        pass
    fast = backends[0] if backends else "torch"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if args.tune_decode:
        return tune_decode(device, dtype, args.smoke)
    if args.tune_gemv is not None:
        return tune_gemv(device, args.tune_gemv)
    if args.diagnose:
        return diagnose(device, dtype)
    if args.profile_host:
        return profile_host(device, dtype, args.smoke)
    if args.sampling_aborts:
        return sampling_aborts(device, dtype, args.smoke)
    if args.only_transfers:
        rows = []
        transfer_rows(rows)
        return print_table(rows)
    print(f"device {name}, torch {torch.__version__}, backends {['torch'] + backends}", flush=True)
    ceil = ceilings(device, args.smoke)
    print(f"ceilings: copy {ceil['copy_bw'] / 1e9:.0f} GB/s, bf16 matmul {ceil['matmul'] / 1e12:.0f} TFLOP/s", flush=True)
    rows = [("device copy bandwidth (GB/s)", ceil["copy_bw"] / 1e9, None, None, "ceiling"),
            ("bf16 matmul (TFLOP/s)", ceil["matmul"] / 1e12, None, None, "ceiling")]

    def load(path):
        if args.smoke:
            return dict(SMOKE_CONFIG)
        with open(os.path.join(HERE, "configs", path)) as f:
            return json.load(f)

    bn, sn = ("smoke", "smoke") if args.smoke else ("8B", "0.5B")
    draw_rows(rows, device, args.smoke)
    big = build(load("llama-3.1-8b.json"), device, dtype)
    ctx1, ctx2, batch, steps = (64, 128, 4, 5) if args.smoke else (1024, 2048, 64, 30)
    for b, (err, norm) in correctness(big, backends, device, dtype).items():
        rows.append((f"{bn} logits, {b} vs torch, mixed batch: max|d|/max|ref|", err, 2e-2, None, "< 2e-2"))
        rows.append((f"{bn} logits, {b} vs torch, mixed batch: norm(d)/norm(ref)", norm, 2e-2, None, "< 2e-2"))
        print(rows[-2:], flush=True)

    if device.type == "cuda":
        eager = engine_for(big, fast, 8192, device, dtype, graphs=False)
        linear_diagnostics(big, ceil["copy_bw"])
        profile_step(eager, 1, ctx1)
        te = decode_step_time(eager, 1, ctx1, steps)
        need = (weight_bytes(big) + kv_bytes(big, ctx1, dtype)) / ceil["copy_bw"]
        rows.append((f"{bn} batch-1 decode, {ctx1} ctx, no CUDA graph: step ms (roofline ms)", te * 1e3, need * 1e3,
                     need / te, "(for comparison)"))
        print(rows[-1], flush=True)
        del eager
        same, total = graph_vs_eager(big, fast, device, dtype, ctx1)
        rows.append((f"{bn} greedy tokens, CUDA-graph vs eager decode steps, 8 prompts together and 1 alone x 32 "
                     f"tokens: prompts equal", same, total, same / total, "== 1 (check)"))
        print(rows[-1], flush=True)
    if device.type == "cuda":
        cap, err = fp8_kv(big, fast, device, dtype)
        rows.append((f"{bn} FP8 KV: tokens vs bf16 in the same memory (x)", cap, 2.0, cap / 2.0, "2x +-5%"))
        rows.append((f"{bn} FP8 KV: first-token logits vs bf16 KV (max rel err)", err, 5e-2, None, "< 5e-2"))
        t8, t16 = fp8_kv_decode(big, fast, device, dtype, ctx1, steps)
        rows.append((f"{bn} FP8 KV, batch-1 decode, {ctx1} ctx, CUDA graph: step ms (bf16 KV ms)", t8 * 1e3,
                     t16 * 1e3, t16 / t8, "(for comparison)"))
        print(rows[-3:], flush=True)
    def batch1_row(engine, model, label, target, steps=steps):
        """Batch-1 decode at ctx1 against the roofline (every weight + the context's KV once per step)."""
        print(f"  {label} batch-1 step phases: {step_phases(engine, 1, ctx1, steps)}", flush=True)
        t = decode_step_time(engine, 1, ctx1, steps)
        need = (weight_bytes(model) + kv_bytes(model, ctx1, dtype)) / ceil["copy_bw"]
        rows.append((f"{label} batch-1 decode, {ctx1} ctx: step ms, steady state (roofline ms)", t * 1e3,
                     need * 1e3, need / t, target))
        ts = decode_step_time(engine, 1, ctx1, steps, synced=True)
        rows.append((f"{label} batch-1 decode, {ctx1} ctx: step ms, each step synced (steady state ms)", ts * 1e3,
                     t * 1e3, t / ts, "(for comparison)"))
        print(rows[-2:], flush=True)
        return t

    if device.type == "cuda":
        # The same step with every kernel launched the ordinary way: what PDL is worth (kernels/pdl.py).
        os.environ["PDSERVE_PDL"] = "0"
        e = engine_for(big, fast, 8192, device, dtype)
        t_nopdl = decode_step_time(e, 1, ctx1, steps)
        del e
        os.environ.pop("PDSERVE_PDL")
        gc.collect()
        torch.cuda.empty_cache()
    e = engine_for(big, fast, batch * (ctx2 + 64) + 4096, device, dtype)
    t_bf16 = batch1_row(e, big, bn, ">= 0.85")
    if device.type == "cuda":
        rows.append((f"{bn} batch-1 decode, {ctx1} ctx: step ms without PDL (with PDL)", t_nopdl * 1e3,
                     t_bf16 * 1e3, t_nopdl / t_bf16, "(for comparison)"))
        print(rows[-1], flush=True)
    variant_rows(e, big, bn, t_bf16, rows, ctx1, steps)
    sampled_rows(e, bn, t_bf16, rows, ctx1, steps)
    # A long context: the decode graphs are planned for the model's whole context, so this replays one too.
    ctx_long = 512 if args.smoke else 32768
    t = decode_step_time(e, 1, ctx_long, steps)
    need = (weight_bytes(big) + kv_bytes(big, ctx_long, dtype)) / ceil["copy_bw"]
    rows.append((f"{bn} batch-1 decode, {ctx_long} ctx: step ms (roofline ms)", t * 1e3, need * 1e3, need / t,
                 "(for comparison)"))
    print(rows[-1], flush=True)
    if args.smoke:  # the timing path itself, on whatever backend there is
        print(f"  attention times: {attention_times(e, [fast], batch, ctx2, 2)}", flush=True)
    if "flashinfer" in backends:
        at = attention_times(e, ["triton", "flashinfer"], batch, ctx2, 50)
        rows.append((f"{bn} attention, batch-{batch} {ctx2} ctx, one layer, {e.pool.layout} pages: triton us "
                     f"(flashinfer us)",
                     at["triton"] * 1e6, at["flashinfer"] * 1e6, at["flashinfer"] / at["triton"], ">= 1.0"))
        print(rows[-1], flush=True)
    if "flashinfer" in backends:  # the other page layout, for comparison
        other = "NHD" if e.pool.layout == "HND" else "HND"
        e2 = engine_for(big, fast, batch * (ctx2 + 64) + 4096, device, dtype, graphs=False, layout=other)
        at2 = attention_times(e2, ["triton", "flashinfer"], batch, ctx2, 50)
        print(f"  attention with {other} pages: triton {at2['triton'] * 1e6:.0f} us, flashinfer "
              f"{at2['flashinfer'] * 1e6:.0f} us (default {e.pool.layout}: triton {at['triton'] * 1e6:.0f} us, "
              f"flashinfer {at['flashinfer'] * 1e6:.0f} us)", flush=True)
        del e2
        gc.collect()
        torch.cuda.empty_cache()
    t64 = decode_step_time(e, batch, ctx2, steps)
    need = (weight_bytes(big) + batch * kv_bytes(big, ctx2, dtype)) / ceil["copy_bw"]
    rows.append((f"{bn} batch-{batch} decode, {ctx2} ctx: step ms, steady state (roofline ms)", t64 * 1e3,
                 need * 1e3, need / t64, ">= 0.75"))
    ts = decode_step_time(e, batch, ctx2, steps, synced=True)
    rows.append((f"{bn} batch-{batch} decode, {ctx2} ctx: step ms, each step synced (steady state ms)", ts * 1e3,
                 t64 * 1e3, t64 / ts, "(for comparison)"))
    print(rows[-2:], flush=True)
    n_prefill = 256 if args.smoke else 8192
    tp = prefill_time(e, n_prefill)
    flops = prefill_flops(big, n_prefill)
    rows.append((f"{bn} prefill {n_prefill} tokens: TFLOP/s (matmul TFLOP/s)", flops / tp / 1e12, ceil["matmul"] / 1e12,
                 flops / tp / ceil["matmul"], ">= 0.60"))
    print(rows[-1], flush=True)
    del e
    if device.type == "cuda":
        # FP8 weights last: quantizing swaps the model's linears in place.
        torch.cuda.empty_cache()
        e = engine_for(big, fast, 8192, device, dtype, quantization="fp8", graphs=False)
        profile_step(e, 1, ctx1)
        del e
        e = engine_for(big, fast, 8192, device, dtype, quantization="fp8")
        print(f"  FP8 batch-1 step phases: {step_phases(e, 1, ctx1, steps)}", flush=True)
        t_fp8 = decode_step_time(e, 1, ctx1, steps)
        rows.append((f"{bn} FP8 weights, batch-1 decode, {ctx1} ctx: step ms (bf16 ms)", t_fp8 * 1e3, t_bf16 * 1e3,
                     t_bf16 / t_fp8, ">= 1.6x"))
        print(rows[-1], flush=True)
        # The model's linears are FP8 now, so the experiment's engine runs FP8 too.
        variant_rows(e, big, f"{bn} FP8", t_fp8, rows, ctx1, steps)
        tokens = greedy_tokens(e, ctx1, 32)
        del e
        # The LM head in FP8 as well (opt-in: --quantize-lm-head).
        e = None
        try:
            e = engine_for(big, fast, 8192, device, dtype, quantization="fp8", lm_head=True)
            t_head = statistics.median(decode_step_time(e, 1, ctx1, steps) for _ in range(3))
            ours = greedy_tokens(e, ctx1, 32)
            same = next((i for i, (a, b) in enumerate(zip(ours, tokens)) if a != b), len(tokens))
            rows.append((f"{bn} FP8 weights and LM head (--quantize-lm-head), batch-1 decode, {ctx1} ctx: step "
                         f"ms (bf16 ms), median of 3; greedy tokens as with the bf16 head: the first {same} of 32",
                         t_head * 1e3, t_bf16 * 1e3, t_bf16 / t_head, ">= 1.6x"))
        except Exception as ex:  # the rows after this one still run
            rows.append((f"{bn} FP8 weights and LM head", None, None, None, f"failed: {ex!r:.120}"))
        print(rows[-1], flush=True)
        del e
    del big
    if device.type == "cuda":
        torch.cuda.empty_cache()

    small = build(load("qwen2.5-0.5b.json"), device, dtype)
    if device.type == "cuda":  # where the small step's time goes, kernel by kernel
        e = engine_for(small, fast, 8192, device, dtype, graphs=False)
        profile_step(e, 1, ctx1)
        del e
    e = engine_for(small, fast, 8192, device, dtype)
    # A 0.5B step is under a millisecond: more of them, so that one slow host moment weighs less.
    steps_small = steps if args.smoke else 200
    t_small = batch1_row(e, small, sn, ">= 0.60", steps_small)
    variant_rows(e, small, sn, t_small, rows, ctx1, steps_small,
                 NARROW_EXPERIMENTS if small.config.hidden_size <= small.fold_max_width else EXPERIMENTS)
    sampled_rows(e, sn, t_small, rows, ctx1, steps_small)
    del e
    if device.type == "cuda":
        transfer_rows(rows)
    if args.pd_tokenizer and device.type == "cuda":
        # The service rows: real `pdserve up` processes on this GPU, the 8B layer shapes with the vocabulary of
        # the tokenizer given (the coordinator needs one to serve).
        import tempfile

        from bench.pd import model_dir_for, pd_rows

        torch.cuda.empty_cache()
        model_dir = model_dir_for(os.path.join(HERE, "configs", "llama-3.1-8b.json"), args.pd_tokenizer,
                                  tempfile.mkdtemp(prefix="pdserve-8b-"))
        for r in pd_rows(model_dir):
            rows.append(r)
            print(r, flush=True)
    else:
        rows.append(("TTFT 1P1D vs colocated, greedy 1P1D = colocated", None, None, None,
                     "not run: give --pd-tokenizer (and the service's packages)"))

    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
