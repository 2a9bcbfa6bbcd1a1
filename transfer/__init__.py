"""KV transfer engines, chosen by name; implementations import lazily (nixl is optional)."""

from __future__ import annotations

import importlib

from transfer.base import SendResult, TransferEngine

_BACKENDS = {"tcp": "transfer.tcp:TcpTransfer", "nixl": "transfer.nixl:NixlTransfer",
             "cuda_ipc": "transfer.cuda_ipc:CudaIpcTransfer"}


def available_backends(on_gpu: bool = False) -> list[str]:
    names = ["tcp"] + (["cuda_ipc"] if on_gpu else [])
    try:
        from transfer.nixl import nixl_available

        if nixl_available():
            names.append("nixl")
    except ImportError:
        pass
    return names


def create_transfer(name: str, pool, worker_id: str, host: str) -> TransferEngine:
    if name not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; choose from {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(pool, worker_id, host)


def agree(prefill: dict[str, bytes], decode: dict[str, bytes], wanted: str = "auto") -> str | None:
    """The backend a prefill-decode pair uses (given each side's endpoints by backend): the one asked for,
    or under auto the fastest both have. cuda_ipc counts only between processes of one machine."""
    common = [b for b in ("cuda_ipc", "nixl", "tcp") if b in prefill and b in decode]
    if "cuda_ipc" in common:
        from transfer.cuda_ipc import same_machine

        if not same_machine(prefill["cuda_ipc"], decode["cuda_ipc"]):
            common.remove("cuda_ipc")
    if wanted == "auto":
        return common[0] if common else None
    return wanted if wanted in common else None


__all__ = ["SendResult", "TransferEngine", "agree", "available_backends", "create_transfer"]
