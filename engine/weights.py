"""Reading checkpoint tensors from Hugging Face safetensors (one file or a sharded index)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
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


_SAMPLES, _SAMPLE_BYTES = 8, 1 << 16


def checkpoint_digest(path: str) -> str:
    """A short fingerprint of the checkpoint's weights: config.json, and of each safetensors file its header and
    eight 64 KiB samples spread over its data. Prefill and decode workers pair only when theirs agree, since
    KV computed by one set of weights is garbage to another of the same shapes (two fine-tunes of one base,
    a rolling upgrade caught half way). It reads about half a megabyte a file, not the weights, so a change
    confined to bytes between the samples (one tensor edited by hand) goes unseen; training changes them all."""
    h = hashlib.sha256(json.dumps(read_json(os.path.join(path, "config.json")), sort_keys=True).encode())
    for file in safetensors_files(path):
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(header_len))
            start = 8 + header_len
            span = max(size - start - _SAMPLE_BYTES, 0)
            for i in range(_SAMPLES):
                f.seek(start + span * i // max(_SAMPLES - 1, 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]
