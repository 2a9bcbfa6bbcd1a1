"""The KV pool: one device tensor holding every layer's K and V, cut into pages.

Layout [layers, pages, 2 (k, v), page_size, kv_heads, head_dim]. One page of one layer is contiguous (K then
V), and the whole pool is one allocation, so it can be registered once with a transfer engine, and a request's
pages move as a list of page ids. Page 0 is never handed out: it pads page tables, and it stays zero so a
backend that reads past a sequence's end reads zeros, never NaN.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.data = torch.zeros(
            (num_layers, num_pages, 2, page_size, kv_heads, head_dim), dtype=dtype, device=self.device
        )

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def max_total_num_tokens(self) -> int:
        return self.usable_pages * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        return self.data[:, 0].numel() * self.data.element_size()

    def layer(self, layer_id: int) -> torch.Tensor:
        return self.data[layer_id]

    def write(self, layer_id: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store new tokens' K and V ([N, kv_heads, head_dim]) at (page, offset) slots."""
        layer = self.data[layer_id]
        layer[pages, 0, offsets] = k.to(self.dtype)
        layer[pages, 1, offsets] = v.to(self.dtype)

    @classmethod
    def pages_for_budget(cls, budget_bytes: int, page_size: int, bytes_per_token: int) -> int:
        return max(0, budget_bytes // (page_size * bytes_per_token))
