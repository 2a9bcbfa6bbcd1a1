"""The rows that compare: each backend against torch, FP8 KV against bf16, CUDA-graph steps against eager
ones, the device draw against the sampler's formula, and each batch-1 variant against the default step."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import os
import statistics

import torch

from bench.measure import decode_step_time, engine_for, greedy_tokens, random_prompt
from engine.engine import Engine
from engine.sampling_params import SamplingParams


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


def truncation_rows(rows: list, device, smoke: bool) -> None:
    """Top-k / top-p on the device: the thresholds selected digit by digit (kernels/truncation.py) keep the
    tokens the sorted definition keeps (rows of bf16 values, which tie), and what each takes in a CUDA graph,
    at batch 1, 8 and 64."""
    from engine.sampler import sorted_top_k_top_p
    from kernels.truncation import thresholds

    def _top_k_top_p(logits, top_k, top_p, **rules):  # what the sampler runs on a GPU
        return logits.masked_fill(logits < thresholds(logits, top_k, top_p, **rules)[:, None], float("-inf"))

    vocab = 1000 if smoke else 151936
    g = torch.Generator(device=device).manual_seed(1)
    for batch in (1, 8, 64):
        scale = torch.rand(batch, 1, device=device, generator=g) * 8 + 0.5
        logits = (torch.randn(batch, vocab, device=device, generator=g) * scale).bfloat16().float()
        top_k = torch.where(torch.arange(batch, device=device) % 3 == 1, 50, 0)
        top_p = torch.full((batch,), 0.9, device=device)
        top_p[2::3] = 1.0
        if batch == 1:
            top_k.zero_()
        rules = dict(use_top_k=batch > 1, use_top_p=True)  # as the sampler asks: only the rules some row uses
        ref = torch.isfinite(sorted_top_k_top_p(logits, top_k, top_p, **rules))
        same = int((torch.isfinite(_top_k_top_p(logits, top_k, top_p, **rules)) == ref).all(dim=-1).sum())
        times = {}
        for name, fn in (("selected", _top_k_top_p), ("sorted", sorted_top_k_top_p)):
            fn(logits, top_k, top_p, **rules)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(logits, top_k, top_p, **rules)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                graph.replay()
            end.record()
            end.synchronize()
            times[name] = start.elapsed_time(end) / 50 * 1e3
        rows.append((f"top-p 0.9 (top-k 50 on a third of the rows), {batch} x {vocab} bf16 logits, in a CUDA graph: "
                     f"selected us (sorted us); rows keeping the sorted definition's tokens: {same} of {batch}",
                     times["selected"], times["sorted"], times["sorted"] / times["selected"], "(for comparison)"))
        print(rows[-1], flush=True)


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


class _OneUlp:
    """The model with one value of one token's embedding moved by one ulp of its dtype, for the run's length:
    the smallest change to the model's input there is. How far that moves the logits is the floor under any
    comparison of two backends that round differently (docs/benchmarks.md, Z82)."""

    def __init__(self, model, token: int):
        self.row, self.old = model.embed_tokens.weight[token], None

    def __enter__(self):
        self.old = self.row[0].clone()
        moved = self.old.clone()
        bits = moved.view(torch.int16) if moved.element_size() == 2 else moved.view(torch.int32)
        bits += 1  # the next representable magnitude
        self.row[0] = moved

    def __exit__(self, *exc):
        self.row[0] = self.old


def correctness(model, backends, device, dtype) -> dict:
    """Each backend's logits against torch's on the same mixed batches: decodes plus new prefill chunks.
    A row is compared only where both runs fed the request the same tokens (greedy choices can differ at
    near-ties, after which the two runs compute different sequences). "torch-ulp" is the torch backend again
    with one input value one ulp off (_OneUlp): what this model does with no backend difference at all."""
    vocab = model.config.vocab_size
    runs, outs = {}, {}
    names = ["torch", "torch-ulp"] + backends + [b + "-eager" for b in backends if b == "triton"]
    if device.type == "cuda":
        names.append("torch-fp32")  # the yardstick for every bf16 backend
    prompts = [random_prompt(200 + 50 * i, vocab, i) for i in range(4)]
    prompts += [random_prompt(300 + 70 * i, vocab, i) for i in range(4, 7)]
    for name in names:
        m = copy.deepcopy(model).float() if name == "torch-fp32" else model
        e = engine_for(m, name.split("-")[0], 16384, device, torch.float32 if name == "torch-fp32" else dtype,
                       chunk=1024, graphs=not name.endswith("-eager"))
        rows, order = record_rows(e)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        reqs = []
        with _OneUlp(m, prompts[0][0]) if name == "torch-ulp" else contextlib.nullcontext():
            for i in range(4):
                reqs.append(e.add_request(prompts[i], params))
                order[reqs[-1].rid] = i
            e.step()  # prefill of the first four
            for i in range(4, 7):  # new prompts join running decodes: mixed batches
                reqs.append(e.add_request(prompts[i], params))
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


def fp8_kv_capacity(model, backend: str, device, dtype) -> float:
    """Token capacity of an FP8 pool / a bf16 pool in the same memory."""
    caps = {}
    gc.collect()
    for kv in ("auto", "fp8_e4m3"):
        torch.cuda.empty_cache()  # memory cached by earlier runs would count as used
        e = engine_for(model, backend, None, device, dtype, graphs=False, kv=kv, mem_fraction=0.3)
        caps[kv] = e.pool.max_total_num_tokens
        del e
        torch.cuda.empty_cache()
    return caps["fp8_e4m3"] / caps["auto"]


def fp8_kv_error(model, backend: str, device, dtype, unit_scales: bool = False) -> tuple[float, str]:
    """(max rel. error of first-token logits with FP8 KV against bf16 KV on the same prompts, the FP8 pool's
    scales). `unit_scales`: the FP8 pool at scale 1.0 instead of its scales from the weights."""
    logits, scales = {}, ""
    vocab = model.config.vocab_size
    for kv in ("auto", "fp8_e4m3"):
        e = engine_for(model, backend, 16384, device, dtype, graphs=False, kv=kv)
        if kv != "auto":
            if unit_scales:
                e.pool.set_scales([1.0] * e.pool.num_layers, [1.0] * e.pool.num_layers)
            scales = (f"K {min(e.pool.k_scale):g}..{max(e.pool.k_scale):g}, "
                      f"V {min(e.pool.v_scale):g}..{max(e.pool.v_scale):g}")
        seen = record_logits(e)
        for i in range(6):
            e.add_request(random_prompt(100 + 150 * i, vocab, i), SamplingParams(temperature=0, max_tokens=1))
        while e.has_work():
            e.step()
        logits[kv] = torch.cat(seen)
        del e
    err = ((logits["fp8_e4m3"] - logits["auto"]).abs().max() / logits["auto"].abs().max()).item()
    return err, scales


def raise_kv_biases(model, k_bias: float = 1500.0, v_bias: float = 900.0) -> None:
    """Values three times e4m3's range, as some Qwen2 checkpoints' K biases: k_bias on one channel of every KV
    head, -0.8 k_bias on another (of the other rope half), v_bias on one V channel. Changes `model` in place."""
    c = model.config
    for layer in model.layers:
        bias = layer.self_attn.qkv_proj.bias
        for h in range(c.num_key_value_heads):
            bias[c.q_size + h * c.head_dim + 1] += k_bias
            bias[c.q_size + h * c.head_dim + c.head_dim // 2 + 3] -= 0.8 * k_bias
        bias[c.q_size + c.kv_size + 5] += v_bias


def request_kv(engine: Engine, tokens: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(the request's tokens whose KV is stored, that KV as attention reads it: [layers, tokens, 2, heads, D],
    stored values times their scales) after running `tokens` for max_tokens greedy tokens."""
    req = engine.add_request(tokens, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    req.hold_pages = True  # keep its pages after it finishes, as a prefill worker's request does
    while engine.has_work():
        engine.step()
    pool, dev = engine.pool, engine.pool.device
    pos = torch.arange(req.kv_len, device=dev)
    index = pool.slot_index(torch.tensor(req.pages, device=dev)[pos // pool.page_size], pos % pool.page_size)
    kv = torch.stack([pool.read(i, index).float() * torch.tensor([pool.k_scale[i], pool.v_scale[i]], device=dev)
                      .view(1, 2, 1, 1) for i in range(pool.num_layers)])
    return req.tokens[: req.kv_len], kv


def fp8_kv_outliers(model, backend: str, device, dtype, n: int = 24) -> tuple[float, float, str]:
    """The model's K and V biases raised beyond e4m3's range (raise_kv_biases): the KV an FP8 pool holds for a
    200-token prompt and n decode steps in CUDA graphs (prefill's rope store, then the qkv GEMV's), against a
    bf16 pool's for the same tokens: (max|d|/max|ref| at the pool's scales from the weights, the same for
    the prompt and tokens prefilled into an FP8 pool at scale 1.0, the scales)."""
    raise_kv_biases(model)
    prompt = random_prompt(200, model.config.vocab_size, 7)
    e = engine_for(model, backend, 4096, device, dtype, kv="fp8_e4m3")
    scales = f"K {min(e.pool.k_scale):g}..{max(e.pool.k_scale):g}, V {min(e.pool.v_scale):g}..{max(e.pool.v_scale):g}"
    tokens, scaled = request_kv(e, prompt, n)
    del e
    e = engine_for(model, backend, 4096, device, dtype, graphs=False)
    _, ref = request_kv(e, tokens, 1)
    del e
    e = engine_for(model, backend, 4096, device, dtype, graphs=False, kv="fp8_e4m3")
    e.pool.set_scales([1.0] * e.pool.num_layers, [1.0] * e.pool.num_layers)
    _, unit = request_kv(e, tokens, 1)
    del e
    gc.collect()
    err = lambda a: ((a - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    return err(scaled), err(unit), scales


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
                      "PDSERVE_NORM_SQUARES_SUMMED": ("1", "the residual add's last program sums the partial sums "
                                                           "of squares into one for the next norm"),
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


def sampled_rows(engine: Engine, label: str, t_greedy: float, rows: list, ctx: int, steps: int) -> None:
    """Batch-1 steps that sample, against the greedy step: a temperature alone is drawn inside the decode
    graph; top-p first selects each row's threshold (kernels/truncation.py), and top-p under a small top-k
    sorts what top-k keeps instead."""
    for name, fields in (("temperature 1", dict(temperature=1.0)),
                         ("temperature 0.8, top-p 0.95", dict(temperature=0.8, top_p=0.95)),
                         ("temperature 0.8, top-k 50, top-p 0.95", dict(temperature=0.8, top_k=50, top_p=0.95))):
        t = decode_step_time(engine, 1, ctx, steps, sampling=fields)
        rows.append((f"{label} batch-1 decode, {ctx} ctx, sampled at {name}: step ms (greedy ms)", t * 1e3,
                     t_greedy * 1e3, t_greedy / t, "(for comparison)"))
        print(rows[-1], flush=True)


def fp8_checkpoint_check(model, backend: str, device, dtype, ctx: int, n: int = 32) -> tuple[int, float]:
    """A copy of `model` quantized by --quantization fp8, written out as a compressed-tensors FP8 checkpoint
    (per-channel scales) and loaded back through engine/checkpoint_quant.py: the same FP8 weights and scales
    in the loaded model's buffers, so its greedy tokens and logits must be the quantized model's exactly.
    Returns (how many of the n greedy tokens agree, max |logit difference| over them)."""
    import tempfile

    from safetensors.torch import save_file

    from engine.checkpoint_quant import Fp8Checkpoint
    from engine.loader import build_model
    from kernels.fp8_linear import Fp8Linear, quantize_model

    quantized = copy.deepcopy(model)
    quantize_model(quantized)
    c = quantized.config
    parts = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), (c.q_size, c.kv_size, c.kv_size)),
             "gate_up_proj": (("gate_proj", "up_proj"), (c.intermediate_size,) * 2)}
    tensors = {}
    for name, module in quantized.named_modules():
        if isinstance(module, Fp8Linear):
            prefix, _, ours = name.rpartition(".")
            names, sizes = parts.get(ours, ((ours,), (module.out_features,)))
            rows = module.weight_rows.split(list(sizes))
            scales = module.scale.view(-1).split(list(sizes))
            biases = module.bias.split(list(sizes)) if module.bias is not None else [None] * len(names)
            for theirs, w, s, b in zip(names, rows, scales, biases):
                tensors[f"model.{prefix}.{theirs}.weight"] = w.contiguous().cpu()
                tensors[f"model.{prefix}.{theirs}.weight_scale"] = s.reshape(-1, 1).cpu()
                if b is not None:
                    tensors[f"model.{prefix}.{theirs}.bias"] = b.contiguous().cpu()
    for name, p in quantized.named_parameters():
        if "_proj." not in name:  # embedding, norms, the head
            tensors[f"model.{name}" if not name.startswith("lm_head") else name] = p.detach().cpu()
    with tempfile.TemporaryDirectory(prefix="pdserve-fp8-ckpt-") as tmp:
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        del tensors
        loaded = build_model(c, dtype, device, weights_dir=tmp, fp8=Fp8Checkpoint("compressed-tensors", ("lm_head",)))
    outs = []
    for m in (quantized, loaded):
        e = engine_for(m, backend, 8192, device, dtype)
        seen = record_logits(e)
        tokens = greedy_tokens(e, ctx, n)
        outs.append((tokens, torch.cat(seen)))
        del e
    same = next((i for i, (a, b) in enumerate(zip(outs[0][0], outs[1][0])) if a != b), n)
    diff = (outs[0][1] - outs[1][1]).abs().max().item() if same == n else float("nan")
    del quantized, loaded
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return same, diff

