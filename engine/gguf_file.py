"""GGUF checkpoints: config, tokenizer and (dequantized) weights, converted once into a cached HF directory.

Parsing a GGUF file and dequantizing it costs seconds; the converted directory (config.json, tokenizer.json,
tokenizer_config.json, safetensors shards and their index) loads in well under one. The cache key is the
file's path, size and mtime plus a format version, so a changed file is converted again.

Quantized tensors are kept in float32, the only format that holds every dequantized value exactly (a block's
float16 scale times its integers), so an 8B Q4_K_M file converts to 32 GB on disk; F16 and BF16 tensors keep
their type. Conversion holds one shard (SHARD_BYTES) in memory at a time, not the whole model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import numpy as np
import torch

from engine.config import ModelConfig
from engine.env import Env
from engine.gguf_tokenizer import tokenizer_files

logger = logging.getLogger(__name__)

# 2: rope frequency factors, end-of-turn tokens among the EOS ids, add_bos_token from the file, SentencePiece;
# shards; F16 and BF16 kept as such.
CACHE_FORMAT = 2
SHARD_BYTES = 2 << 30
_INDEX = "model.safetensors.index.json"

# GGUF architecture name -> HF model_type.
_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# Per-layer tensor names, GGUF -> HF.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# The types of the usual llama.cpp files (Q4_K_M holds Q4_K, Q6_K, and Q5_0 or Q8_0 for rows not a multiple of
# 256 wide; Q2_K..Q5_K_M, IQ4_XS and IQ4_NL the others listed), dequantized by gguf-py.
SUPPORTED_QUANT = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ4_NL", "IQ4_XS")
# Tensors that describe the model rather than weigh it.
_ROPE_FREQS = "rope_freqs.weight"

def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs -> HF's half-split layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (HF -> GGUF); the inverse of `unpermute_rope`."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFModel:
    def __init__(self, path: str):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except OSError:
            raise
        except Exception as e:  # the reader's errors on a cut-short file name numpy's reshapes, not the file
            raise ValueError(f"{path}: not a readable GGUF file ({os.path.getsize(path):,} bytes; cut short, or "
                             f"not GGUF?): {e}") from e
        self.arch = self._field("general.architecture")
        if self.arch not in _ARCH:
            raise ValueError(f"{path}: GGUF architecture {self.arch!r} is not supported ({sorted(_ARCH)})")

    def _field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def config(self) -> ModelConfig:
        a = self.arch
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        head_dim = int(self._field(f"{a}.attention.key_length", hidden // heads))
        rotary = self._field(f"{a}.rope.dimension_count")
        if rotary is not None and int(rotary) != head_dim:
            raise ValueError(f"{self.path}: rope over {rotary} of each head's {head_dim} dimensions is not supported")
        tensors = {t.name: t for t in self.reader.tensors}
        # The embedding's row count is the model's vocabulary; the token list may be shorter (padding rows).
        vocab = int(tensors["token_embd.weight"].shape[-1])
        rope = None
        if self._field(f"{a}.rope.scaling.type") == "linear":
            rope = {"rope_type": "linear", "factor": float(self._field(f"{a}.rope.scaling.factor"))}
        if _ROPE_FREQS in tensors:  # Llama 3.x: its rope scaling, as llama.cpp's converter wrote it down
            t = tensors[_ROPE_FREQS]
            if t.tensor_type != 0:  # GGML_TYPE_F32
                raise ValueError(f"{self.path}: {_ROPE_FREQS} must be F32")
            rope = {"rope_type": "frequency_factors", "factors": [float(x) for x in np.asarray(t.data).ravel()]}
        # Instruction-tuned vocabularies end a turn with a token of its own (Llama 3's <|eot_id|>, and
        # <|eom_id|> after a tool call); generation stops at any of them, as llama.cpp stops.
        eos = [self._field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))
        return ModelConfig(
            model_type=_ARCH[a],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._field(f"{a}.feed_forward_length")),
            num_hidden_layers=int(self._field(f"{a}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._field(f"{a}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            max_position_embeddings=int(self._field(f"{a}.context_length", 4096)),
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope,
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=a == "qwen2",
            qk_norm=a == "qwen3",
            sliding_window=self._field(f"{a}.attention.sliding_window"),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def tensors(self):
        """(HF name, tensor) for every tensor, dequantized (F16 and BF16 as they are, the rest in float32), q/k
        rows in HF order."""
        from gguf import GGMLQuantizationType, quants

        cfg = self.config()
        # llama.cpp permutes q/k rows for its interleaved rope only for llama-style architectures.
        permuted = self.arch in ("llama", "mistral")
        for t in self.reader.tensors:
            if t.name == _ROPE_FREQS:  # read into the config
                continue
            qtype = GGMLQuantizationType(t.tensor_type)
            if qtype.name not in SUPPORTED_QUANT:
                raise ValueError(f"{self.path}: tensor {t.name} has unsupported type {qtype.name} "
                                 f"(supported: {', '.join(SUPPORTED_QUANT)})")
            data = np.asarray(quants.dequantize(t.data, qtype), dtype=np.float32)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = data.reshape(shape)
            name = self._hf_name(t.name)
            if permuted and name.endswith("q_proj.weight"):
                data = unpermute_rope(data, cfg.num_attention_heads)
            elif permuted and name.endswith("k_proj.weight"):
                data = unpermute_rope(data, cfg.num_key_value_heads)
            tensor = torch.from_numpy(np.array(data, copy=True, order="C"))
            if qtype.name in ("F16", "BF16"):  # exact: the values came from this type
                tensor = tensor.to(torch.float16 if qtype.name == "F16" else torch.bfloat16)
            yield name, tensor

    @staticmethod
    def _hf_name(name: str) -> str:
        base, _, kind = name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
        raise ValueError(f"unknown GGUF tensor {name!r}")

    def tokenizer_files(self) -> tuple[dict, dict]:
        """(tokenizer.json, tokenizer_config.json) contents built from the GGUF vocabulary."""
        return tokenizer_files(self._field, self.path)


def _cache_dir(path: str) -> str:
    st = os.stat(path)
    key = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(Env.cache_dir(), "gguf", digest)


def convert_gguf(path: str, shard_bytes: int = SHARD_BYTES) -> str:
    """Return an HF-style directory holding the GGUF model, converting it on first use."""
    out = _cache_dir(path)
    if os.path.exists(os.path.join(out, _INDEX)):
        return out
    logger.info("converting %s into %s (once)", path, out)
    model = GGUFModel(path)
    cfg = model.config()
    tk_json, tk_config = model.tokenizer_files()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Write into a temporary directory and rename, so a crash never leaves a half-written cache.
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out))
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f)
        with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
            json.dump(tk_json, f)
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(tk_config, f)
        write_shards(model.tensors(), tmp, shard_bytes)
        os.rename(tmp, out)
    except OSError:
        if not os.path.exists(os.path.join(out, _INDEX)):
            raise
    finally:  # gone after the rename; still here if another process converted it meanwhile or this failed
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_shards(tensors, directory: str, shard_bytes: int) -> None:
    """Safetensors files of at most shard_bytes each (or one tensor, if larger) and their index, written as
    the tensors come."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, os.path.join(directory, name))
        weight_map.update(dict.fromkeys(shard, name))

    for name, t in tensors:
        if shard and size + t.nbytes > shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
    if shard:
        flush()
    with open(os.path.join(directory, _INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
