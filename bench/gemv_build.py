"""The one-token GEMV as built for an H200 (sm_90), on any machine: registers, stack bytes (spilled
registers) and programs per SM of every launch config() picks for the 8B and 0.5B projections. No GPU is
needed: Triton compiles for a named target with the ptxas it ships, and its cuobjdump reads the result.

The GEMV runs many small programs per SM to hide the latency of its weight loads, so a register count that
crosses an allocation step costs a program per SM. Run S1 lost a quarter of o_proj's speed to two registers
(docs/benchmarks.md); compare this table before and after a change to kernels/gemv.py, before timing it.

    python -m bench.gemv_build
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import gemv as G

# name: (rows, K, "glu" / "rope" / None); rope: (query heads, KV heads, head dim) of the shape.
SHAPES = {"8B qkv": (6144, 4096, None), "8B qkv + rope (PDSERVE_FUSE_ROPE)": (6144, 4096, "rope"),
          "8B o": (4096, 4096, None), "8B gate_up + SiLU": (28672, 4096, "glu"), "8B down": (4096, 14336, None),
          "0.5B qkv": (1152, 896, None), "0.5B qkv + rope (PDSERVE_FUSE_ROPE)": (1152, 896, "rope"),
          "0.5B o": (896, 896, None), "0.5B gate_up + SiLU": (9728, 896, "glu"), "0.5B down": (896, 4864, None),
          # The folded norms (PDSERVE_FOLD_NORMS): the residual adds write the stream's squares and the stream
          # times the next norm's weight (a float32 token), which the norms' projections read.
          "8B qkv + rope, norm from squares": (6144, 4096, "rope+sq"), "8B o + residual, squares": (4096, 4096, "res"),
          "8B gate_up + SiLU, norm from squares": (28672, 4096, "glu+sq"),
          "8B down + residual, squares": (4096, 14336, "res"),
          "0.5B qkv + rope, norm from squares": (1152, 896, "rope+sq"),
          "0.5B gate_up + SiLU, norm from squares": (9728, 896, "glu+sq"),
          "0.5B down + residual, squares": (896, 4864, "res")}
HEADS = {6144: (32, 8, 128), 1152: (14, 2, 64)}
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
SHARED_PER_SM = 228 * 1024


def build(n: int, k: int, mode: str | None, fp8: bool):
    """The kernel config() picks for an [n, k] weight, compiled for sm_90, and its launch."""
    mode = mode or ""
    glu, rope, norm, res = mode.startswith("glu"), mode.startswith("rope"), mode.endswith("+sq"), mode == "res"
    bn, bk, warps, stages, split, ahead = G.launch_of(G.config(n, k, torch.device("cuda"), 1 if fp8 else 2, norm,
                                                               glu=glu))
    hq, hkv, dim = HEADS[n] if rope else (1, 1, 2)
    # A folded norm as the model runs it by default: its scale from the squares the residual add left, the
    # token already times the norm's weight.
    flags = dict(HAS_SCALE=fp8, HAS_BIAS=False, NORM=False, NORM_W=False, SQ_IN=512 if norm else 0,
                 SQ_OUT=res, TOKEN_OUT=res, SQ_ONE=False, SQ_BLOCK=1, GLU=glu, ADD_TO_OUT=res, PDL=True, BLOCK_N=bn, BLOCK_K=bk, ROPE=rope, HQ=hq, HKV=hkv,
                 HALF=dim // 2, KV_FP8=False)
    types = {"X": "*bf16", "TOK": "*bf16", "TOK_NW": "*bf16", "SQ_CNT": "*i32", "W": "*i32" if fp8 else "*bf16", "SCALE": "*fp32", "BIAS": "*bf16", "NW": "*bf16",
             "OUT": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32", "eps": "fp32", "SQ": "*fp32", "SQ_N": "i32", "R_COS": "*bf16",
             "R_SIN": "*bf16", "R_KV": "*bf16", "R_PAGE": "*i64", "R_SLOT": "*i64", "r_sp": "i32", "r_skv": "i32",
             "r_ss": "i32", "r_sh": "i32", "r_limit": "fp32", "r_kinv": "fp32", "r_vinv": "fp32", "WORK": "*fp32", "COUNTERS": "*i32"}
    fn = G._gemv_kernel
    if fp8:
        even = n % bn == 0 and k % (bk * split) == 0
        flags |= dict(PTX=True, EVEN=even, SPLIT=split, AHEAD=ahead)
        fn = G._gemv_e4m3_kernel
    sig = {name: "constexpr" if name in flags else types[name] for name in fn.arg_names}
    names = list(sig)
    # As a launch with 16-byte aligned pointers and sizes sees them (torch's allocations, the model's shapes).
    aligned = ("X", "W", "SCALE", "BIAS", "NW", "OUT", "N", "K", "stride_wn", "SQ", "WORK", "COUNTERS")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in names}
    src = ASTSource(fn=fn, signature=sig, constexprs=flags, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps,
                                                                                 num_stages=stages))
    return compiled, (bn, bk, warps, stages, split, ahead)


def resources(compiled) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) from cuobjdump's resource usage: registers that do not
    fit spill to the stack frame, in local memory."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gemv.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)), int(stack.group(1)) if stack else 0


def programs_per_sm(regs: int, warps: int, shared: int) -> int:
    """Resident programs per SM: registers are allocated per warp in 256s; then the warp and shared limits."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // per_warp // warps
    by_shared = SHARED_PER_SM // shared if shared else by_regs
    return min(by_regs, MAX_WARPS_PER_SM // warps, by_shared)


def main() -> None:
    print(f"triton {triton.__version__}, sm_90")
    print("| projection | weights | launch | registers | stack bytes | shared bytes | programs per SM |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k, mode) in SHAPES.items():
        for fp8 in (False, True):
            compiled, launch = build(n, k, mode, fp8)
            regs, stack = resources(compiled)
            shared = compiled.metadata.shared
            print(f"| {name} | {'FP8' if fp8 else 'bf16'} | {launch} | {regs} | {stack} | {shared} | "
                  f"{programs_per_sm(regs, launch[2], shared)} |", flush=True)


if __name__ == "__main__":
    main()
