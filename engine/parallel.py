"""Tensor parallelism: Megatron-style sharding of the decoder over `size` ranks.

Column-parallel (output dim split): qkv_proj (by heads), gate_up_proj; row-parallel (input dim split, output
all-reduced): o_proj, down_proj; vocab-parallel: embed_tokens (rows split, lookups all-reduced) and the LM
head (logits all-gathered). Norms are replicated. Each rank keeps num_heads/size query heads and
num_kv_heads/size KV heads, so its KV pool holds only its heads; with more ranks than KV heads (a 4-KV-head
model on 8 GPUs), each rank keeps the one KV head its query heads share, as size/num_kv_heads ranks do. The
group is passed explicitly; nothing here is global. With size 1 every operation is the plain one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.env import Env


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup; None with size 1
    device: object = None  # this rank's torch.device: where NCCL wants the tensors of small collectives
    # Collectives go through host copies: a gloo group of GPU ranks (PDSERVE_TP_BACKEND=gloo), which gloo
    # cannot all-gather directly. Such a group cannot run inside CUDA graphs; the engine runs it without.
    staged: bool = False

    def shard_config(self, c: ModelConfig) -> ModelConfig:
        """This rank's view of the model: its share of heads and of the MLP width (vocab stays whole)."""
        if self.size == 1:
            return c
        for name, v in (("num_attention_heads", c.num_attention_heads), ("intermediate_size", c.intermediate_size)):
            if v % self.size:
                raise ValueError(f"--tp {self.size} does not divide {name} ({v})")
        kv = c.num_key_value_heads
        if kv % self.size and self.size % kv:
            raise ValueError(f"--tp {self.size} neither divides num_key_value_heads ({kv}) nor is a multiple of it")
        return dataclasses.replace(c, num_attention_heads=c.num_attention_heads // self.size,
                                   num_key_value_heads=max(1, kv // self.size),
                                   intermediate_size=c.intermediate_size // self.size)

    def first_kv_head(self, total: int) -> int:
        """The first of this rank's KV heads among `total`. With more ranks than KV heads, size // total
        consecutive ranks hold the same head: the one their query heads read."""
        return self.rank * total // self.size

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """(first row, end row, rows held) of this rank's vocabulary shard; the last shard is padded."""
        per = -(-vocab // self.size)
        start = self.rank * per
        return start, min(start + per, vocab), per

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """x reduced over the ranks, in place."""
        if self.size == 1:
            return x
        if self.staged:
            host = x.cpu()
            dist.all_reduce(host, op=op, group=self.group)
            return x.copy_(host)
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, op=dist.ReduceOp.MIN).item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        part = x.contiguous().cpu() if self.staged else x.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1).to(x.device)



def leave_group() -> None:
    """Leave this process's group, if it has one, so that it can start another (an `LLM` made after one was
    closed), and so that no gloo thread is left talking to a rank that exits."""
    if dist.is_initialized():
        dist.destroy_process_group()


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    if size == 1:
        return TensorParallel()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts, so its communicator lands on this rank's GPU
    backend = Env.tp_backend() or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"PDSERVE_TP_BACKEND must be nccl or gloo, got {backend!r}")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    return TensorParallel(rank, size, dist.group.WORLD, device, staged=backend == "gloo" and device.type == "cuda")
