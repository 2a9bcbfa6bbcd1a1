"""The attention interface the model calls.

A step's tokens arrive flat ([N, heads, head_dim]); request boundaries and KV locations come in the
FlashInfer-style paged layout below. `plan()` runs once per forward pass and turns that layout into whatever
the backend needs; the returned step object's `forward()` then runs once per layer: it stores the new K/V in
the pool and attends over each request's cached prefix plus its new tokens (causally).

Index map for request b (tokens of the step are [qo_indptr[b], qo_indptr[b+1]) ):
    KV positions   0 .. prefix_lens[b]-1             already in the pool (cached prefix / earlier steps)
    KV positions   prefix_lens[b] .. seq_lens[b]-1   written by this step, token t at position prefix+t
    pages          kv_indices[kv_indptr[b] : kv_indptr[b+1]]   in order; position p lives in
                   page (p // page_size), slot (p % page_size)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionInputs:
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32, into kv_indices
    kv_indices: torch.Tensor  # [total pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32, tokens in each request's last page (1..page_size)
    seq_lens: torch.Tensor  # [B] int32, KV length after this step
    prefix_lens: torch.Tensor  # [B] int32, KV length before this step
    out_pages: torch.Tensor  # [N] int64, page of each new token
    out_offsets: torch.Tensor  # [N] int64, slot within that page
    max_seq_len: int
    max_extend_len: int

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.out_pages.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_extend_len == 1

    def to(self, device) -> "AttentionInputs":
        t = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
             for k, v in self.__dict__.items()}
        return AttentionInputs(**t)


class AttentionStep(ABC):
    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]; stores k/v into the pool first."""


class AttentionBackend(ABC):
    def __init__(self, pool, config):
        self.pool = pool
        self.config = config

    @abstractmethod
    def plan(self, inputs: AttentionInputs) -> AttentionStep:
        """Prepare one forward pass; inputs are already on the pool's device."""
