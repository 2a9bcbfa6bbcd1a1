"""Programmatic dependent launch (PDL, Hopper and later): let a kernel start while its predecessor finishes.

Inside a decode graph each kernel otherwise waits for the previous one to drain, then pays its own launch and
the latency of its first loads from HBM; at batch 1 that is a few hundred dependent kernels a step. A kernel
launched with PDL is scheduled as soon as every program of the previous kernel has signalled
(`gdc_launch_dependents`), loads what the previous kernel cannot have written (weights, the step's static
index tensors) and only then waits (`gdc_wait`) for the previous kernel's results.

Rules every kernel here follows, because the wait is what keeps the stream's order:
- every program calls `gdc_wait()` before it writes anything or reads an activation, so a grid never
  completes before its predecessor (its successor waits on it alone). A program that does neither may return
  without waiting only if some program of its grid always waits: the split-KV decode kernel's empty splits
  return at once, and the first split of every request waits;
- `gdc_launch_dependents()` comes after the wait, so at most one grid is waiting ahead of the running one,
  and a waiting grid's early weight loads do not compete with a kernel two steps back. One exception: the
  split-KV merge kernel, tiny and reading no weights, signals first, so that o_proj launches during the
  attention, whose KV reads leave the memory mostly idle (then two grids wait: the merge and o_proj).
  Correctness holds either way: a grid completes only after its own wait, so completion stays in order.
The kernels take a `PDL` constexpr and are launched with `launch_pdl=PDL`; without PDL the calls compile
out, and the launch is an ordinary one (the interpreter and pre-Hopper GPUs). PDSERVE_PDL=0 turns it off.
"""

from __future__ import annotations

import functools

import torch

from engine.env import Env

try:
    import triton
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 (used by kernels)
except ImportError:  # CPU installs without triton, or a triton without grid dependency control
    triton = None


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels reading x should be launched with PDL."""
    if triton is None or not x.is_cuda or not Env.pdl():
        return False
    return _capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capable(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9
