"""KV transfer engines, chosen by name; implementations import lazily (nixl is optional)."""

from __future__ import annotations

import importlib

import msgspec

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


# A tensor-parallel worker publishes one endpoint per rank under each backend, joined into one value that the
# coordinator passes along untouched: rank r of a sender talks only to rank r of its peer.
_RANKS = b"pdserve-ranks\x00"


def join_rank_endpoints(endpoints: list[bytes]) -> bytes:
    return endpoints[0] if len(endpoints) == 1 else _RANKS + msgspec.msgpack.encode(list(endpoints))


def rank_endpoints(endpoint: bytes) -> list[bytes]:
    """Each rank's endpoint in a published one (a worker without tensor parallelism has one rank)."""
    if not endpoint.startswith(_RANKS):
        return [endpoint]
    try:
        eps = msgspec.msgpack.decode(endpoint[len(_RANKS):], type=list[bytes])
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed per-rank endpoint: {e}") from None
    if not eps:
        raise ValueError("per-rank endpoint lists no rank")
    return eps


def agree(prefill: dict[str, bytes], decode: dict[str, bytes], wanted: str = "auto") -> str | None:
    """The backend a prefill-decode pair uses (given each side's endpoints by backend): the one asked for,
    or under auto the fastest both have. cuda_ipc counts only where each rank's pool is on the same GPU as
    the peer rank's (workers sharing a GPU; processes of one machine)."""
    common = [b for b in ("cuda_ipc", "nixl", "tcp") if b in prefill and b in decode]
    if "cuda_ipc" in common:
        from transfer.cuda_ipc import same_gpu

        try:
            pairs = list(zip(rank_endpoints(prefill["cuda_ipc"]), rank_endpoints(decode["cuda_ipc"]), strict=True))
            near = all(same_gpu(a, b) for a, b in pairs)
        except ValueError:  # a malformed endpoint, or ranks that do not pair up
            near = False
        if not near:
            common.remove("cuda_ipc")
    if wanted == "auto":
        return common[0] if common else None
    return wanted if wanted in common else None


__all__ = ["SendResult", "TransferEngine", "agree", "available_backends", "create_transfer", "join_rank_endpoints",
           "rank_endpoints"]
