"""Attention backends, chosen by name. Implementations import lazily so `import kernels` needs no GPU."""

from __future__ import annotations

import importlib

from kernels.attention.base import AttentionBackend, AttentionInputs

_BACKENDS = {
    "torch": "kernels.attention.torch_backend:TorchBackend",
    "triton": "kernels.attention.triton_backend:TritonBackend",
    "flashinfer": "kernels.attention.flashinfer_backend:FlashInferBackend",
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def default_backend(device) -> str:
    """The fastest backend that can run on `device`: Triton on a GPU when it is installed, else torch."""
    import torch

    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            pass
    return "torch"


def create_backend(name: str, pool, config, dtype=None) -> AttentionBackend:
    """`dtype`: the queries' (the model's activations); by default the pool's, which an FP8 pool's is not."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {backend_names()}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(pool, config, dtype)


__all__ = ["AttentionBackend", "AttentionInputs", "backend_names", "create_backend", "default_backend"]
