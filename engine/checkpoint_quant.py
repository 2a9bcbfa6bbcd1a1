"""Checkpoints whose weights are quantized already: which ones are served, and where their tensors go.

FP8 (e4m3) weights with one scale per tensor or per output channel are served as they are, by the same
projections that `--quantization fp8` makes (kernels/fp8_linear.py), whichever tool wrote them:
compressed-tensors ("float-quantized": llm-compressor's FP8 and FP8-dynamic checkpoints), vLLM's "fp8"
serialization and fbgemm_fp8. A per-tensor scale becomes the scale of each of its rows, so q, k and v (and
gate and up) with scales of their own still load into one merged projection, exactly. Activation scales
that a checkpoint carries for static quantization are not used: activations are quantized per token as
they come (or not at all, for the weight-only kernels of small batches), which is at least as exact.

FP8 weights with block-wise scales (one per 128 x 128 tile: Qwen3's and DeepSeek's FP8 releases) are
dequantized to the model's dtype as they load and served as an unquantized checkpoint would be: the FP8
kernels here take one scale per row, and a block's scale is not one. They run, at bf16's memory and speed.

Everything else is refused with the reason: integer formats (AWQ, GPTQ, bitsandbytes), group-wise scales, a
quantized LM head or embedding, and q/k/v or gate/up quantized differently from each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from kernels.fp8_linear import FP8, Fp8Linear

SERVED = "FP8 weights with a scale per tensor or per output channel (compressed-tensors, fp8, fbgemm_fp8)"
# Our projections, and the checkpoint's linears that load into each.
_PROJECTIONS = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}


@dataclass(frozen=True)
class Fp8Checkpoint:
    method: str
    # Linears left in the model's dtype: full names ("lm_head", "model.layers.0.mlp.down_proj"), or
    # regular expressions after "re:" matched from a name's start (compressed-tensors' convention).
    ignore: tuple[str, ...] = ()
    # (rows, columns) of the tiles that share a scale, for block-wise checkpoints (served dequantized).
    block: tuple[int, int] | None = None

    def quantized(self, name: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], name):
                    return False
            elif name == entry or name.startswith(entry + "."):
                return False
        return True


def read(config: dict) -> Fp8Checkpoint | None:
    """The FP8 checkpoint that config.json describes, None for an unquantized one; ValueError for a
    quantization that is not served."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")

    def refuse(why: str):
        raise ValueError(f"checkpoint quantization {method!r}: {why}; served: {SERVED}")

    block = None
    if method == "compressed-tensors":
        if qc.get("format") not in ("float-quantized", "naive-quantized"):
            refuse(f"format {qc.get('format')!r}")
        for name, group in (qc.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if (w.get("type"), w.get("num_bits")) != ("float", 8):
                refuse(f"group {name} has {w.get('num_bits')}-bit {w.get('type')} weights")
            if w.get("strategy") == "block" and len(w.get("block_structure") or ()) == 2:
                block = tuple(int(b) for b in w["block_structure"])
            elif w.get("strategy") not in ("tensor", "channel") or w.get("group_size"):
                refuse(f"group {name} has weight scales by {w.get('strategy')}")
            if any(t != "Linear" for t in group.get("targets") or ()):
                refuse(f"group {name} targets {group.get('targets')}")
        return Fp8Checkpoint(method, tuple(qc.get("ignore") or ()), block)
    if method == "fp8":
        if qc.get("weight_block_size"):
            if len(qc["weight_block_size"]) != 2:
                refuse(f"block-wise scales {qc['weight_block_size']}")
            block = tuple(int(b) for b in qc["weight_block_size"])
        return Fp8Checkpoint(method, tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()), block)
    if method == "fbgemm_fp8":
        return Fp8Checkpoint(method, tuple(qc.get("modules_to_not_convert") or ()))
    refuse("not an FP8 format")


def install(model: nn.Module, spec: Fp8Checkpoint) -> int:
    """Replace the decoder's linears that the checkpoint quantized with empty Fp8Linears (on the model's
    device, meta while it is built); returns how many (none for a block-wise checkpoint, served dequantized)."""
    if spec.block is not None:
        return 0
    count = 0
    for i, layer in enumerate(model.layers):
        for (part, ours), theirs in _PROJECTIONS.items():
            kinds = {spec.quantized(f"model.layers.{i}.{part}.{t}") for t in theirs}
            if len(kinds) > 1:
                raise ValueError(f"layer {i}: {', '.join(theirs)} are not all quantized; they are served as one "
                                 f"projection ({ours}), which takes one format")
            if kinds.pop():
                parent = getattr(layer, part)
                linear = getattr(parent, ours)
                setattr(parent, ours, Fp8Linear(linear.in_features, linear.out_features, linear.bias,
                                                device=linear.weight.device))
                count += 1
    return count


def load(module: Fp8Linear, name: str, leaf: str, rows: tuple[int, int] | None, tensor: torch.Tensor) -> str | None:
    """Put a checkpoint tensor of an FP8 projection in place: its weight, or its scale (rows: where this
    checkpoint linear's rows start in the merged projection, and how many). Returns what was loaded
    ("weight" or "weight_scale"), or None for a tensor that is not used (static activation scales)."""
    if leaf == "input_scale":
        return None
    start, size = rows if rows is not None else (0, module.out_features)
    if leaf == "weight":
        if tensor.dtype != FP8:
            raise ValueError(f"{name}: {tensor.dtype} weights where the checkpoint's quantization says FP8 "
                             f"(float8_e4m3fn)")
        dst = module.weight_rows.narrow(0, start, size)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
        dst.copy_(tensor)
        return leaf
    if leaf == "weight_scale":
        dst = module.scale.view(-1).narrow(0, start, size)
        if tensor.numel() == 1:  # per tensor: the scale of each of its rows
            dst.fill_(tensor.float().item())
        elif tensor.numel() == size:  # per output channel ([out] or [out, 1])
            dst.copy_(tensor.float().view(-1))
        else:
            raise ValueError(f"{name}: {tuple(tensor.shape)} scales for {size} rows (served: one per tensor or "
                             f"one per row)")
        return leaf
    raise ValueError(f"{name}: an FP8 checkpoint tensor that is not served (served: weight, weight_scale, "
                     f"input_scale)")


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """A block-wise FP8 checkpoint's tensors with each FP8 weight dequantized (float32), once both it and its
    scales (`weight_scale`, or `weight_scale_inv` as transformers names them: the factor the FP8 values are
    multiplied by) have come; static activation scales dropped; every other tensor as it is."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        module, _, leaf = name.rpartition(".")
        if leaf == "input_scale":
            continue
        if leaf in ("weight_scale", "weight_scale_inv") or (leaf == "weight" and t.dtype == FP8):
            pair = pending.setdefault(module, {})
            pair["weight" if leaf == "weight" else "scale"] = t
            if len(pair) == 2:
                del pending[module]
                yield f"{module}.weight", _dequantize(f"{module}.weight", pair["weight"], pair["scale"], block)
            continue
        yield name, t
    if pending:
        raise ValueError(f"FP8 weights or scales without their other half: {sorted(pending)[:4]}")


def _dequantize(name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape
    br, bc = block
    if tuple(scale.shape) != (-(-rows // br), -(-cols // bc)):
        raise ValueError(f"{name}: scales {tuple(scale.shape)} for a {rows} x {cols} weight in {br} x {bc} blocks")
    full = scale.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.float() * full
