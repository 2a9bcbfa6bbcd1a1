"""Model architecture description, read from a Hugging Face `config.json` (or built from GGUF metadata).

One dataclass covers the decoder families we serve: they differ only in a few switches (qkv bias, q/k norm,
rope scaling, sliding window), which is what lets one model implementation run them all.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}



def read_json(path: str) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; a file that is not one is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON object was expected, not {type(data).__name__}")
    return data

@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # Rope scaling as found in the checkpoint ({"rope_type": "llama3", "factor": ...}), or None. GGUF files give
    # Llama 3's scaling as one divisor per rotary frequency (their rope_freqs tensor), which is kept as such:
    # {"rope_type": "frequency_factors", "factors": [head_dim / 2 floats]}.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3", "linear", "frequency_factors"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        if rope_type == "frequency_factors" and len(self.rope_scaling["factors"]) != self.head_dim // 2:
            raise ValueError(f"rope frequency factors: {len(self.rope_scaling['factors'])} given, the heads' "
                             f"{self.head_dim // 2} rotary frequencies need one each")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                model_type = SUPPORTED_ARCHITECTURES[arch]
                break
        if model_type not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"unsupported model (architectures={archs}, model_type={model_type!r}); "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type", "default") == "default":
            rope = {}
        sliding = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        file = os.path.join(path, "config.json")
        try:
            config = cls.from_hf_dict(read_json(file))
        except (KeyError, TypeError) as e:  # a field missing, or of a type arithmetic cannot take
            raise ValueError(f"{file}: not a usable model config ({type(e).__name__}: {e})") from e
        # Chat checkpoints often name their end-of-turn token only in generation_config.json (Llama 3:
        # <|eot_id|> beside config.json's <|end_of_text|>); generation stops at either, as transformers stops.
        gen = os.path.join(path, "generation_config.json")
        if os.path.exists(gen):
            eos = read_json(gen).get("eos_token_id")
            more = eos if isinstance(eos, list) else [eos] if eos is not None else []
            ids = tuple(dict.fromkeys([*config.eos_token_ids, *(int(i) for i in more)]))
            config = dataclasses.replace(config, eos_token_ids=ids)
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        """The inverse of `from_hf_dict`, used to cache converted GGUF models as plain HF directories."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]
        rope = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        return {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }
