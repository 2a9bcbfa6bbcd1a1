"""What folding the norms into the one-token GEMVs costs, kernel by kernel (`python -m bench.gpu --fold-kernels`).

Two views, both printed as tables:
- one layer of an eager batch-1 8B step, each kernel's device time in launch order, with the norms unfolded,
  folded reading the prepared token, and folded multiplying by the norm's weight (PDL off, so that a kernel's
  time does not include its wait for the one before);
- each GEMV variant of those layers alone, replayed in a CUDA graph over copies of its weights that L2
  cannot hold: the norm gathered in the K loop, taken from the residual add's partial sums of squares (512,
  as the 8B o_proj and down_proj leave them, or one), with or without the token; the residual adds with and
  without the squares and the token. Each variant's output is checked against torch's formula first, so a
  variant that is fast because it is wrong shows.
"""

from __future__ import annotations

import gc
import json
import os
import time

import torch
import torch.nn.functional as F

from bench.measure import HERE, SMOKE_CONFIG, build, engine_for, in_graph, random_prompt, sync
from engine.sampling_params import SamplingParams
from kernels.gemv import TokenSquares, gemv

EPS = 1e-5
FOLD_VARIANTS = {"unfolded": {"PDSERVE_FOLD_NORMS": "0"},
                 "folded, token": {"PDSERVE_FOLD_NORMS": "1", "PDSERVE_NORM_TOKEN": "1"},
                 "folded, no token": {"PDSERVE_FOLD_NORMS": "1", "PDSERVE_NORM_TOKEN": "0"}}


def layer_kernels(model, device, dtype, env: dict, quantization=None, ctx: int = 1024) -> list[tuple[str, float]]:
    """The kernels of one eager batch-1 decode step, in launch order: (name, device us)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    saved = {k: os.environ.get(k) for k in [*env, "PDSERVE_PDL"]}
    os.environ.update(env, PDSERVE_PDL="0")
    try:
        e = engine_for(model, "triton", 8192, device, dtype, graphs=False, quantization=quantization)
        req = e.add_request(random_prompt(ctx, model.config.vocab_size, 1),
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        while req.num_output < 4:  # past the prefill and the first decode steps' compilations
            e.step()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            e.step()
            sync()
        e.abort(req.rid)
        del e
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        gc.collect()
        torch.cuda.empty_cache()
    kernels = sorted((x for x in prof.events() if x.device_type == DeviceType.CUDA), key=lambda x: x.time_range.start)
    return [(x.name, x.time_range.elapsed_us()) for x in kernels]


def one_layer(kernels: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """The kernels of a middle layer: from a decode-attention kernel halfway through the step to the next one,
    shifted to start after it (qkv, attention, o_proj, ... as the layer runs)."""
    starts = [i for i, (name, _) in enumerate(kernels) if "decode_split" in name or "decode_kernel" in name]
    if len(starts) < 3:
        return kernels
    a = starts[len(starts) // 2]
    b = starts[len(starts) // 2 + 1]
    return kernels[a - 1:b - 1]


def _reference(x, w, scale, glu, norm_w):
    xf = x.float()
    if norm_w is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.float()
    wf = w.float() * (scale[:, None] if scale is not None else 1)
    y = xf @ wf.t()
    if glu:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    return y


def gemv_variants(device, smoke: bool) -> list[tuple]:
    """Rows (shape, weights, variant, us, GB/s of weights, max rel error against torch)."""
    h, inter, qkv = (128, 256, 256) if smoke else (4096, 14336, 6144)
    g = torch.Generator(device=device).manual_seed(0)
    cuda = device.type == "cuda"
    rows = []
    for fp8 in (False, True):
        shapes = [("qkv (no rope)", qkv, h, False, "norm"), ("gate_up + SiLU", 2 * inter, h, True, "norm"),
                  ("o_proj", h, h, False, "residual"), ("down_proj", h, inter, False, "residual")]
        for label, n, k, glu, role in shapes:
            w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
            scale = None
            if fp8:
                w = w.to(torch.float8_e4m3fn)
                scale = torch.rand(n, device=device, generator=g) + 0.5
            x = torch.randn(1, k, device=device, generator=g).to(torch.bfloat16)
            nw = (torch.rand(k, device=device, generator=g) + 0.5).to(torch.bfloat16)
            counters = torch.zeros(4096, dtype=torch.int32, device=device)
            # Distinct copies of the weights, 256 MB or more in all on a GPU, so that none is read from L2
            # (the 8B qkv and o_proj would fit in it); each is timed once per replay.
            ws = [w] + [w.clone() for _ in range(max(1, -(-(256 << 20) // (w.numel() * w.element_size()))) - 1)
                        ] if cuda else [w]

            last = {}

            def once(fn):
                t0 = time.perf_counter()
                out = fn(w)
                last["s"] = time.perf_counter() - t0
                return out

            def time_of(fn):
                if cuda:
                    return in_graph(lambda: [fn(wc) for wc in ws], 1) / len(ws)
                # On the CPU (Triton's interpreter, in tests) the one run already made is the figure: a second
                # would double the time the test takes.
                return last["s"]
            kw = dict(scale=scale, glu=glu, counters=counters)
            if role == "norm":
                variants = {"plain (no norm)": (None, 0, False), "norm gathered in the K loop": (nw, 0, False)}
                for parts in (min(512, k), 1):
                    sums = f"{parts} partial sum{'s' if parts > 1 else ''}"
                    variants[f"norm from {sums}, weight in the K loop"] = (nw, parts, False)
                    variants[f"norm from {sums}, token"] = (nw, parts, True)
                for name, (norm_w, parts, token) in variants.items():
                    sq = TokenSquares.new(device, width=k if token else 0, token_dtype=torch.bfloat16)
                    if parts:
                        sq.buf[:parts] = x.float().pow(2).reshape(parts, -1).sum(-1)
                    if token:
                        sq.token.copy_((x.float() * nw.float()).to(torch.bfloat16)[0])

                    def fn(w, norm_w=norm_w, parts=parts, token=token, sq=sq):
                        sq.count, sq.token_norm = parts, (nw if token else None)
                        norm = (norm_w, EPS) if norm_w is not None else None
                        return gemv(x, w, norm=norm, squares=sq if parts else None, **kw)
                    # The token is x * weight rounded once: the reference rounds the same way.
                    ref = _reference(x, w, scale, glu, norm_w)
                    err = float((once(fn).float() - ref).abs().max() / ref.abs().max())
                    t = time_of(fn)
                    rows.append((label, "FP8" if fp8 else "bf16", name, t * 1e6, w.numel() * w.element_size() / t / 1e9,
                                 err))
            else:
                next_w = (torch.rand(n, device=device, generator=g) + 0.5).to(torch.bfloat16)
                r0 = torch.randn(1, n, device=device, generator=g).to(torch.bfloat16)
                for name, (squares, token, summed) in {
                        "residual add": (False, False, False), "residual add, squares": (True, False, False),
                        "residual add, squares, token": (True, True, False),
                        "residual add, squares summed to one, token": (True, True, True)}.items():
                    sq = TokenSquares.new(device, width=n if token else 0, token_dtype=torch.bfloat16, summed=summed)
                    r = r0.clone()

                    def fn(w, squares=squares, token=token, sq=sq, r=r):
                        return gemv(x, w, residual=r, squares=sq if squares else None,
                                    next_norm=next_w if token else None, scale=scale, counters=counters)
                    once(fn)
                    ref = r0.float() + _reference(x, w, scale, False, None)
                    err = float((r.float() - ref).abs().max() / ref.abs().max())
                    if squares:  # the partial sums add up to the stream's, and the token is it times the weight
                        total = float(sq.buf[:sq.count].sum())
                        err = max(err, abs(total - float(r.float().pow(2).sum())) / float(r.float().pow(2).sum()))
                        if token:
                            want = (r.float() * next_w.float())[0]
                            err = max(err, float((sq.token.float() - want).abs().max() / want.abs().max()))
                    t = time_of(fn)
                    rows.append((label, "FP8" if fp8 else "bf16", name, t * 1e6, w.numel() * w.element_size() / t / 1e9,
                                 err))
            print(rows[-1], flush=True)
    return rows


def compiled_registers() -> list[tuple]:
    """(kernel, warps, registers, spilled registers, flags) of every GEMV this process compiled: the machine's
    own Triton and ptxas, which `python -m bench.gemv_build` (any machine's) only predicts."""
    from kernels import gemv as G

    out = []
    for fn in (G._gemv_kernel, G._gemv_e4m3_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for k in cache[0].values():
                src = getattr(k, "src", None)
                consts = getattr(src, "constants", None) or getattr(src, "constexprs", None) or {}
                named = {(a if isinstance(a, str) else fn.arg_names[a[0]]): v for a, v in consts.items()}
                flags = " ".join(f"{a}={named[a]}" for a in ("BLOCK_N", "BLOCK_K", "SPLIT", "GLU", "ROPE", "ADD_TO_OUT",
                                                             "SQ_IN", "SQ_OUT", "TOKEN_OUT", "SQ_ONE", "NORM_W")
                                 if a in named)
                out.append((getattr(fn, "__name__", None) or fn.fn.__name__, k.metadata.num_warps,
                            getattr(k, "n_regs", None), getattr(k, "n_spills", None), flags))
    return out


def fold_kernels(device, dtype, smoke: bool) -> None:
    if device.type == "cuda":
        cfg = dict(SMOKE_CONFIG) if smoke else json.load(open(os.path.join(HERE, "configs", "llama-3.1-8b.json")))
        model = build(cfg, device, dtype)
        for quantization in (None, "fp8"):  # FP8 last: quantizing swaps the model's linears in place
            print(f"\n{'FP8' if quantization else 'bf16'} weights, one middle layer of an eager batch-1 step "
                  f"(device us, PDL off)")
            for name, env in FOLD_VARIANTS.items():
                kernels = layer_kernels(model, device, dtype, env, quantization, 64 if smoke else 1024)
                layer = one_layer(kernels)
                print(f"| {name} | {len(kernels)} kernels, {sum(t for _, t in kernels):.0f} us | "
                      + " | ".join(f"{n[:20]} {t:.1f}" for n, t in layer) + " |", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    rows = gemv_variants(device, smoke)
    print("\n| projection | weights | variant | us | GB/s of weights | max rel error vs torch |")
    print("|---|---|---|---|---|---|")
    for label, weights, name, us, gbs, err in rows:
        print(f"| {label} | {weights} | {name} | {us:.2f} | {gbs:.0f} | {err:.2g} |")
    if device.type == "cuda":
        print("\n| kernel | warps | registers | spilled | flags |")
        print("|---|---|---|---|---|")
        for name, warps, regs, spills, flags in compiled_registers():
            print(f"| {name} | {warps} | {regs} | {spills} | {flags} |")
