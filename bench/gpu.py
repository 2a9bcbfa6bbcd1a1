"""GPU benchmark suite: one command, one table of figures against ceilings measured in the same run.

    python -m bench.gpu                      # on a GPU: the engine rows (about three minutes on an H200)
    python -m bench.gpu --pd-tokenizer DIR   # and the service rows: 1P1D vs colocated `pdserve up` (bench/pd.py)
    python -m bench.gpu --smoke              # tiny shapes, any device: checks that the suite runs
    python -m bench.gpu --fold-kernels       # what folding the norms costs, kernel by kernel (bench/fold.py)

Models are random-weight builds of real shapes (bench/configs/). Ceilings: device copy bandwidth (bytes read
+ written per second) and the bf16 matmul rate, both measured here first. Each row prints the figure, its
ceiling or peer, the ratio and the target. Diagnostics print before the table: matmuls timed inside CUDA
graphs, a profile of eager decode steps, the page-copy sweep of the cuda_ipc row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch

from bench.checks import (
    EXPERIMENTS, NARROW_EXPERIMENTS, correctness, draw_rows, truncation_rows, fp8_checkpoint_check, fp8_kv_capacity,
    fp8_kv_decode, fp8_kv_error, fp8_kv_outliers, graph_vs_eager, sampled_rows,
    variant_rows)
from bench.diagnostics import (
    diagnose, linear_diagnostics, profile_host, profile_step, sampling_aborts, tune_decode, tune_gemv)
from bench.measure import (
    HERE, SMOKE_CONFIG, attention_times, build, ceilings, decode_step_time, engine_for, greedy_tokens, kv_bytes,
    prefill_flops, prefill_time, print_table, step_phases, weight_bytes)
from bench.transfers import transfer_rows


def seeded_truncated_tokens(engine) -> list[list[int]]:
    """Eight seeded requests decoded together (top-p 0.9, half of them also top-k 40): their tokens."""
    from bench.measure import random_prompt
    from engine.sampling_params import SamplingParams

    reqs = [engine.add_request(random_prompt(40 + 20 * i, engine.config.vocab_size, i),
                               SamplingParams(temperature=0.9, top_p=0.9, top_k=40 if i % 2 else 0, seed=i,
                                              max_tokens=32, ignore_eos=True)) for i in range(8)]
    while engine.has_work():
        engine.step()
    return [r.output_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, seconds, any device")
    ap.add_argument("--tune-decode", action="store_true",
                    help="the decode kernel's settings for large batches, each planned as an eager step and as a "
                         "CUDA graph plans it, and the batch-64 step with the fastest")
    ap.add_argument("--diagnose", action="store_true", help="kernel profiles of eager 8B decode steps")
    ap.add_argument("--fold-kernels", action="store_true",
                    help="what folding the norms costs: one layer's kernels per variant, each GEMV variant alone "
                         "(bench/fold.py; on a CPU, under TRITON_INTERPRET=1)")
    ap.add_argument("--profile-host", action="store_true", help="Python's profile of eager decode and prefill steps")
    ap.add_argument("--only-transfers", action="store_true", help="only the KV transfer rows (cuda_ipc, nixl, tcp)")
    ap.add_argument("--only-sampling", action="store_true",
                    help="only the sampling rows: the draw kernel, top-k/top-p, and the 0.5B sampled steps")
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
    if args.fold_kernels:
        from bench.fold import fold_kernels

        return fold_kernels(device, dtype, args.smoke)
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
    if device.type == "cuda":
        truncation_rows(rows, device, args.smoke)
    if args.only_sampling:
        small = build(load("qwen2.5-0.5b.json"), device, dtype)
        e = engine_for(small, fast, 8192, device, dtype)
        steps = 5 if args.smoke else 200
        t = decode_step_time(e, 1, 1024, steps)
        sampled_rows(e, sn, t, rows, 1024, steps)
        if device.type == "cuda":  # the same top-p step with the rows sorted instead, graphs captured afresh
            t_selected = rows[-1][1] / 1e3
            selected_tokens = seeded_truncated_tokens(e)
            os.environ["PDSERVE_SELECT_TRUNCATION"] = "0"
            e.runner.graphs.truncating.clear()
            t_sorted = decode_step_time(e, 1, 1024, steps, sampling=dict(temperature=0.8, top_p=0.95))
            same = sum(a == b for a, b in zip(seeded_truncated_tokens(e), selected_tokens))
            del os.environ["PDSERVE_SELECT_TRUNCATION"]
            e.runner.graphs.truncating.clear()
            rows.append((f"{sn} batch-1 decode, 1024 ctx, top-p 0.95 with the rows sorted instead "
                         "(PDSERVE_SELECT_TRUNCATION=0): step ms (selected ms)", t_sorted * 1e3, t_selected * 1e3,
                         t_sorted / t_selected, "(for comparison)"))
            rows.append((f"{sn} seeded top-p / top-k requests, 8 together x 32 tokens, selected vs sorted "
                         "truncation: requests drawing the same tokens", same, 8, same / 8, "== 1 (check)"))
        return print_table(rows)
    big = build(load("llama-3.1-8b.json"), device, dtype)
    ctx1, ctx2, batch, steps = (64, 128, 4, 5) if args.smoke else (1024, 2048, 64, 30)
    for b, (err, norm) in correctness(big, backends, device, dtype).items():
        if b == "torch-ulp":  # no backend difference: the floor under the rows of the other backends
            what, target = "torch with one embedding value one ulp off vs torch (this model's own spread)", "(floor)"
        else:
            what, target = f"{b} vs torch", "< 2e-2"
        rows.append((f"{bn} logits, {what}, mixed batch: max|d|/max|ref|", err, 2e-2, None, target))
        rows.append((f"{bn} logits, {what}, mixed batch: norm(d)/norm(ref)", norm, 2e-2, None, target))
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
        cap = fp8_kv_capacity(big, fast, device, dtype)
        rows.append((f"{bn} FP8 KV: tokens vs bf16 in the same memory (x)", cap, 2.0, cap / 2.0, "2x +-5%"))
        for b in backends:
            err, scales = fp8_kv_error(big, b, device, dtype)
            rows.append((f"{bn} FP8 KV ({scales}), {b}: first-token logits vs bf16 KV (max rel err)", err, 5e-2,
                         None, "< 5e-2"))
        err, _ = fp8_kv_error(big, fast, device, dtype, unit_scales=True)
        rows.append((f"{bn} FP8 KV at scale 1.0, {fast}: first-token logits vs bf16 KV (max rel err)", err, 5e-2,
                     None, "(for comparison)"))
        t8, t16 = fp8_kv_decode(big, fast, device, dtype, ctx1, steps)
        rows.append((f"{bn} FP8 KV, batch-1 decode, {ctx1} ctx, CUDA graph: step ms (bf16 KV ms)", t8 * 1e3,
                     t16 * 1e3, t16 / t8, "(for comparison)"))
        print(rows[-(3 + len(backends)):], flush=True)
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
    same, diff = fp8_checkpoint_check(small, fast, device, dtype, ctx1)
    rows.append((f"{sn} FP8 checkpoint (compressed-tensors, per channel) loaded, vs --quantization fp8 of the same "
                 f"weights: greedy tokens equal of 32 (max |logit difference|)", same, 32, same / 32, "== 32 (0.0)"))
    rows.append((f"{sn} FP8 checkpoint, max |logit difference| over those steps", diff, None, None, "0.0"))
    print(rows[-2:], flush=True)
    if small.config.attention_bias:  # last: it changes the model's biases
        scaled, unit, scales = fp8_kv_outliers(small, fast, device, dtype)
        rows.append((f"{sn} with K/V biases of 1,500 / 900, FP8 KV ({scales}): prompt + 24 decode steps' KV vs "
                     "bf16 KV (max|d|/max|ref|)", scaled, 2.0 ** -4, None, "< 2^-4 (e4m3 rounding)"))
        rows.append((f"{sn} with K/V biases of 1,500 / 900, FP8 KV at scale 1.0: the prompt's KV vs bf16 KV "
                     "(max|d|/max|ref|)", unit, None, None, "(saturates at 448)"))
        print(rows[-2:], flush=True)
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
        try:
            for r in pd_rows(model_dir):
                rows.append(r)
                print(r, flush=True)
        except Exception as e:  # a cluster that does not come up (a missing package) costs its rows, not the table
            rows.append(("TTFT 1P1D vs colocated, greedy 1P1D = colocated", None, None, None,
                         f"not run: {type(e).__name__}: {e}"[:300]))
    else:
        rows.append(("TTFT 1P1D vs colocated, greedy 1P1D = colocated", None, None, None,
                     "not run: give --pd-tokenizer (and the service's packages)"))

    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
