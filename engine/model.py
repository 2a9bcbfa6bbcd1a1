"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3.

The model works on a flat batch of tokens: `input_ids` and `positions` are [N], where the N tokens are the
concatenation of every request's new tokens in this step (prefill chunks and single decode tokens alike).
Everything about which request a token belongs to, and where its K/V lives, is in the attention metadata
that the attention backend planned for this step; the model itself never sees request boundaries.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from engine import checkpoint_quant
from engine.config import ModelConfig
from engine.env import Env
from engine.parallel import TensorParallel
from kernels.cpu_linear import linear
from kernels.fp8_linear import FP8, Fp8Linear
from kernels.fused import add_rms_norm, rms_norm_ref, silu_and_mul
from kernels.gemv import available as gemv_available
from kernels.gemv import TokenSquares, gemv
from kernels.rope import apply_rope_ref


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the activation dtype; the reference does the same.
        return rms_norm_ref(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(norm(x + residual), x + residual): one fused kernel on the GPU."""
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind == "frequency_factors":  # llama.cpp's rope_freqs: each frequency divided by its own factor
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    return inv_freq


class Rotary(nn.Module):
    """Rotary embedding with the half-split layout (rotate_half), cos/sin precomputed for every position."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.tables: dict = {}  # (dtype, device) -> [positions, 2, D]: cos and signed sin, made on first use
        self.build()

    def build(self) -> None:
        """(Re)compute the tables on the buffers' device; called again after a model is built on `meta`."""
        device = self.cos.device if self.cos.device.type != "meta" else torch.device("cpu")
        inv_freq = rope_inv_freq(self.config)
        pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * inv_freq[None, :]
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated): one op fewer per use.
        self.cos = torch.cat([freqs, freqs], dim=-1).cos().to(device)
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(device)
        self.tables = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for the step's tokens, [N, 1, D] (views of one [N, 2, D] gather): gathered once per
        forward for all layers. The tables are kept in the activation dtype, cos beside sin, so that a step
        gathers both in one kernel rather than two gathers and two conversions (rounded as those were)."""
        key = (dtype, self.cos.device)
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = torch.stack([self.cos, self.sin], dim=1).to(dtype)
        both = table[positions]
        return both[:, :1], both[:, 1:]

    @staticmethod
    def apply(cos_sin, x: torch.Tensor) -> torch.Tensor:
        return apply_rope_ref(cos_sin, x)  # x: [N, heads, D]


class Linear(nn.Linear):
    """A projection that takes the one-token Triton GEMV on a GPU (kernels/gemv.py). At batch 1 a decode step
    is a chain of a few hundred dependent kernels; the GEMV starts streaming its weights before the previous
    kernel has finished (PDL), which cuBLAS cannot do inside our graph, and never splits K into a second
    reduction kernel. `glu=True` (gate_up_proj): the output is silu(gate) * up, fused into the GEMV."""

    def forward(self, x: torch.Tensor, glu: bool = False, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None, rope=None, squares: TokenSquares | None = None,
                next_norm: RMSNorm | None = None) -> torch.Tensor:
        """`norm`, `residual`, `rope` and `squares` (one token; CausalLM decided the GEMV runs): project
        norm(x), add the projection to `residual` in place and return it, or rotate and store q, k, v
        (kernels/gemv.py)."""
        if norm is not None or residual is not None or rope is not None:
            return gemv(x, self.weight, bias=self.bias, glu=glu, norm=None if norm is None else (norm.weight, norm.eps),
                        residual=residual, rope=rope, squares=squares,
                        next_norm=None if next_norm is None else next_norm.weight)
        if x.shape[0] == 1 and gemv_available(x) and x.dtype == self.weight.dtype:
            return gemv(x, self.weight, bias=self.bias, glu=glu)
        y = linear(x, self.weight, self.bias)
        return silu_and_mul(y) if glu else y


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.layer_id = layer_id
        self.config = config  # this rank's share of the heads
        self.tp = tp
        c = config
        self.qkv_proj = Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.attention_bias)
        self.o_proj = Linear(c.q_size, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin, attn, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None, fuse_rope: bool = False,
                squares: TokenSquares | None = None, next_norm: RMSNorm | None = None) -> torch.Tensor:
        """`norm`/`residual`: the folded one-token path (DecoderLayer.forward_folded); `fuse_rope`: rope and
        the KV store in the qkv GEMV (CausalLM.fuses_rope)."""
        c = self.config
        n = x.shape[0]
        if fuse_rope:
            q = self.qkv_proj(x, norm=norm, squares=squares,
                              rope=attn.rope_target(cos_sin, c.num_attention_heads, self.layer_id))
            out = attn.attend(q, self.layer_id)
        else:
            qk, v = self.qkv_proj(x, norm=norm, squares=squares).split([c.q_size + c.kv_size, c.kv_size], dim=-1)
            v = v.view(n, c.num_key_value_heads, c.head_dim)
            qk = qk.view(n, c.num_attention_heads + c.num_key_value_heads, c.head_dim)
            if c.qk_norm:
                q, k = qk.split([c.num_attention_heads, c.num_key_value_heads], dim=1)
                qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
            # Rope on q and k heads together, fused with storing k and v where a kernel is available.
            out = attn.forward_rope(qk, v, cos_sin, c.num_attention_heads, self.layer_id)
        if residual is not None:
            return self.o_proj(out.reshape(n, c.q_size), residual=residual, squares=squares, next_norm=next_norm)
        return self.tp.all_reduce(self.o_proj(out.reshape(n, c.q_size)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None,
                squares: TokenSquares | None = None, next_norm: RMSNorm | None = None):
        if residual is not None:  # the folded one-token path
            return self.down_proj(self.gate_up_proj(x, glu=True, norm=norm, squares=squares), residual=residual,
                                  squares=squares, next_norm=next_norm)
        return self.tp.all_reduce(self.down_proj(self.gate_up_proj(x, glu=True)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = Attention(config, layer_id, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos_sin, attn, fuse_rope: bool = False):
        # The residual stream is carried beside the layer output, so each add fuses into the next norm.
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, cos_sin, attn, fuse_rope=fuse_rope)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual

    def forward_folded(self, stream: torch.Tensor, cos_sin, attn, fuse_rope: bool = False,
                       squares: TokenSquares | None = None, next_norm: RMSNorm | None = None) -> None:
        """One token, one GPU: the norms fold into qkv_proj and gate_up_proj, the residual adds into o_proj and
        down_proj, which update `stream` in place; four kernels for the projections, none for the norms.
        With `squares`, o_proj and down_proj also leave the stream's sum of squares, which the next norm uses
        instead of gathering it in its projection's K loop, and the stream times the next norm's weight
        (`next_norm`: the next layer's input norm, None after the last layer), which that norm's projection
        reads in place of the stream."""
        self.self_attn(stream, cos_sin, attn, norm=self.input_layernorm, residual=stream, fuse_rope=fuse_rope,
                       squares=squares, next_norm=self.post_attention_layernorm)
        self.mlp(stream, norm=self.post_attention_layernorm, residual=stream, squares=squares, next_norm=next_norm)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        self.full_config = config
        # `config` is this rank's view from here on: its heads and MLP width, the whole vocabulary.
        self.config = config = tp.shard_config(config)
        self.vocab_start, self.vocab_end, rows = tp.vocab_range(config.vocab_size)
        # A weight given (not drawn): nn.Embedding's own init imports torch._dynamo on the meta device, 1.5-2 s
        # of every worker's start.
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm; `attn` is the planned attention step."""
        x = self.embed(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        fuse_rope = self.fuses_rope(x)
        if self.folds(x):
            # x is the embedding lookup's own tensor, so it can carry the residual stream in place.
            squares = None
            if Env.norm_squares():
                squares = TokenSquares.new(x.device, width=x.shape[1] if Env.norm_token() else 0, token_dtype=x.dtype,
                                           summed=Env.norm_squares_summed())
            for i, layer in enumerate(self.layers):
                following = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
                layer.forward_folded(x, cos_sin, attn, fuse_rope, squares, following)
            return self.norm.add_norm(x, None)[0]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, attn, fuse_rope)
        return self.norm.add_norm(x, residual)[0]

    # Whether one-token steps fold the norms and residual adds into the projections' GEMV
    # (DecoderLayer.forward_folded): None follows PDSERVE_FOLD_NORMS on a GPU; True/False force it (tests).
    fold_norms: bool | None = None
    # Folding pays where the projections are small, so that the norm kernels' launches weigh more than the
    # work the fold adds to every GEMV program: the 0.5B shape (896 wide) gained 5-7 % on an H200, the 8B
    # (4096) lost 5 %, FP8 weights lost more. Widths in between are unmeasured and do not fold. Those figures
    # are from before the residual adds left the token times the norm's weight (PDSERVE_NORM_TOKEN), which
    # takes the fold's per-element work out of the GEMV programs; the wide shapes are not yet timed with it.
    fold_max_width = 1024

    def folds(self, x: torch.Tensor) -> bool:
        if x.shape[0] != 1 or self.tp.size != 1:
            return False
        if self.fold_norms is not None:
            return self.fold_norms
        if not gemv_available(x):
            return False
        choice = Env.fold_norms()
        if choice is not None:
            return choice
        return self.config.hidden_size <= self.fold_max_width and isinstance(self.layers[0].mlp.down_proj, nn.Linear)

    # Whether one-token steps fold rope and the KV store into the qkv GEMV (kernels/gemv.py, rope=): None
    # follows PDSERVE_FUSE_ROPE on a GPU; True/False force it (tests). Not with q/k norms, which come between.
    fuse_rope: bool | None = None

    def fuses_rope(self, x: torch.Tensor) -> bool:
        if x.shape[0] != 1 or self.config.qk_norm or self.config.head_dim % 2:
            return False
        if self.fuse_rope is not None:
            return self.fuse_rope
        return gemv_available(x) and Env.fuse_rope()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # Vocab-parallel lookup: each rank embeds the ids in its range, zeros elsewhere; the sum is the row.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        x = self.embed_tokens((input_ids - self.vocab_start) * mine) * mine[:, None]
        return self.tp.all_reduce(x)

    # One-token steps on a GPU take a bf16/fp16 LM head through the Triton GEMV, which stores float32 logits
    # as it sums them: no split-K memset, no conversion kernel, and none of cuBLAS's rounding to bf16 first.
    head_gemv = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # A tied head is the embedding table, unless quantization gave it an FP8 copy of its own.
        head = getattr(self, "lm_head", None)
        plain = head is None or type(head) is nn.Linear  # (not an Fp8Linear, whose GEMV takes its scales)
        weight = (self.embed_tokens.weight if head is None else head.weight) if plain else None
        if (self.head_gemv and plain and hidden.shape[0] == 1 and gemv_available(hidden)
                and weight.dtype == hidden.dtype):
            logits = gemv(hidden, weight, out_dtype=torch.float32)
        else:
            logits = (linear(hidden, weight) if plain else head(hidden)).float()
        if self.tp.size > 1:
            logits = self.tp.all_gather_last(logits)[:, : self.config.vocab_size]
        return logits

    # Checkpoint names -> (our parameter, shard index within a merged parameter).
    _MERGED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def _shard(self, target: str, part: int | None, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor (whole tensors with size 1)."""
        tp = self.tp
        if tp.size == 1:
            return t
        c = self.config
        kind = target.split(".")[-2] if "." in target else target
        if kind in ("embed_tokens", "lm_head"):
            start, end, rows = tp.vocab_range(c.vocab_size)
            out = t.new_zeros((rows,) + tuple(t.shape[1:]))
            out[: end - start] = t[start:end]
            return out
        if kind == "qkv_proj":
            if part == 0:
                return t.narrow(0, tp.rank * c.q_size, c.q_size)
            return t.narrow(0, tp.first_kv_head(t.shape[0] // c.head_dim) * c.head_dim, c.kv_size)
        if kind == "gate_up_proj":
            return t.narrow(0, tp.rank * c.intermediate_size, c.intermediate_size)
        if kind in ("o_proj", "down_proj") and t.dim() == 2:
            width = t.shape[1] // tp.size
            return t.narrow(1, tp.rank * width, width)
        return t  # norms: replicated

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; q/k/v and gate/up land in their merged parameters."""
        c = self.config
        params = dict(self.named_parameters())
        shard_sizes = {"qkv_proj": [c.q_size, c.kv_size, c.kv_size], "gate_up_proj": [c.intermediate_size] * 2}
        # Projections of an FP8 checkpoint (engine/checkpoint_quant.py): their weights and scales are buffers.
        fp8 = {n: m for n, m in self.named_modules() if isinstance(m, Fp8Linear)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in self._MERGED:
                merged, shard = self._MERGED[parts[-2]]
                target = ".".join(parts[:-2] + [merged, parts[-1]])
            module_name, _, leaf = target.rpartition(".")
            if module_name in fp8 and leaf != "bias":
                if leaf == "weight" or (leaf == "weight_scale" and tensor.numel() > 1):
                    tensor = self._shard(target, shard, tensor if leaf == "weight" else tensor.reshape(-1))
                rows = None
                if shard is not None:
                    sizes = shard_sizes[module_name.split(".")[-1]]
                    rows = (sum(sizes[:shard]), sizes[shard])
                what = checkpoint_quant.load(fp8[module_name], name, leaf, rows, tensor)
                if what is not None:
                    loaded.add(f"{module_name}.{what}#{shard or 0}")
                continue
            if tensor.dtype == FP8 or name.endswith(("_scale", "_scale_inv")):
                raise ValueError(f"checkpoint tensor {name!r}: quantized where this model is not (served: "
                                 f"{checkpoint_quant.SERVED}, not for the embedding or the LM head)")
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {c.model_type} model")
            param = params[target]
            tensor = self._shard(target, shard, tensor)
            if shard is None:
                dst = param.data
            else:
                sizes = shard_sizes[target.split(".")[-2]]
                dst = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        expected = {f"{n}.{what}#{i}" for n in fp8 for what in ("weight", "weight_scale")
                    for i in range(len(shard_sizes.get(n.split(".")[-1], [0])))}
        for pname in params:
            merged = pname.split(".")[-2] if "." in pname else ""
            if merged in shard_sizes:
                expected.update(f"{pname}#{i}" for i in range(len(shard_sizes[merged])))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
