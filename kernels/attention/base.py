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

import functools
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
    """Set by each backend's step: `pool`, `x` (the AttentionInputs). `fused` None: rope + store in one kernel
    on a GPU; True/False force it (tests)."""

    fused: bool | None = None

    @functools.cached_property
    def write_index(self):
        """pool.slot_index of the step's new tokens, made on first use: where rope and the KV store fold into
        the qkv GEMV (one-token steps), nothing asks for it, and a decode graph has four kernels fewer."""
        return self.pool.slot_index(self.x.out_pages, self.x.out_offsets)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q [N, Hq, D] -> [N, Hq, D], over each request's KV, the step's new tokens already stored."""

    def rope_target(self, cos_sin, num_q_heads: int, layer_id: int):
        """Where a one-token qkv GEMV puts its rotated q, k and v (kernels/gemv.py, rope=); attend(q) next."""
        from kernels.rope import RopeTarget

        cos, sin = cos_sin
        return RopeTarget(cos[0, 0], sin[0, 0], self.pool.tokens_view(layer_id), self.x.out_pages,
                          self.x.out_offsets, num_q_heads, self.pool.k_scale[layer_id], self.pool.v_scale[layer_id])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]; stores k/v into the pool first."""
        self.pool.write(layer_id, self.write_index, k, v)
        return self.attend(q, layer_id)

    def forward_rope(self, qk: torch.Tensor, v: torch.Tensor, cos_sin, num_q_heads: int,
                     layer_id: int) -> torch.Tensor:
        """qk [N, Hq+Hkv, D] before the rotary embedding, v [N, Hkv, D]: rotate, store, attend."""
        from kernels.rope import apply_rope_ref, rope_store, use_fused

        if use_fused(qk, self.fused):
            q = rope_store(qk, v, cos_sin, self.pool.tokens_view(layer_id), self.x.out_pages, self.x.out_offsets,
                           num_q_heads, self.pool.k_scale[layer_id], self.pool.v_scale[layer_id])
            return self.attend(q, layer_id)
        q, k = apply_rope_ref(cos_sin, qk).split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)
        return self.forward(q, k, v, layer_id)


class AttentionBackend(ABC):
    def __init__(self, pool, config, dtype=None):
        self.pool = pool
        self.config = config
        self.dtype = dtype or pool.dtype  # the queries'; an FP8 pool's differs

    @abstractmethod
    def plan(self, inputs: AttentionInputs) -> AttentionStep:
        """Prepare one forward pass; inputs are already on the pool's device."""
