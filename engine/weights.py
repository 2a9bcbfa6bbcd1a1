"""Reading checkpoint tensors from Hugging Face safetensors (one file or a sharded index)."""

from __future__ import annotations

import os
from typing import Iterator

import torch
from safetensors import safe_open

from engine.config import read_json


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        shards = sorted(set(weight_map.values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        try:
            f = safe_open(file, framework="pt")
        except FileNotFoundError:
            raise FileNotFoundError(f"{file}: a shard the checkpoint names is missing") from None
        except Exception as e:  # safetensors' own error type, for a header that is cut short or not one
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
        with f:
            for name in f.keys():
                yield name, f.get_tensor(name)
