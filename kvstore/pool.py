"""The KV pool: one device tensor holding every layer's K and V, cut into pages.

Layout [layers, pages, 2 (k, v), page_size, kv_heads, head_dim] ("NHD": a token's heads side by side) or
[layers, pages, 2, kv_heads, page_size, head_dim] ("HND": each head's tokens of a page side by side, so a
decode kernel reads one contiguous run per page and head). One page of one layer is contiguous (K then
V) either way, and the whole pool is one allocation, so it can be registered once with a transfer engine, and a request's
pages move as a list of page ids. Page 0 is never handed out: it pads page tables, and it stays zero so a
backend that reads past a sequence's end reads zeros, never NaN.

Each layer has a K scale and a V scale (powers of two, 1.0 unless set): the pool stores k / k_scale and
v / v_scale, and attention reads them back times the scale (K's folded into the softmax scale, V's into the
output). They let an FP8 pool hold values beyond the format's range (e4m3: +-448) without saturating; an FP8
pool still saturates what lies beyond range x scale. Powers of two make the division and the product exact.
"""

from __future__ import annotations

import logging
import math

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
        layout: str = "NHD",
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        if layout not in ("NHD", "HND"):
            raise ValueError(f"KV layout must be NHD or HND, got {layout!r}")
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout = layout
        # Under tensor parallelism the pool holds rank tp_rank's share of the KV heads; a page moves only
        # between pools of the same rank and size.
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        inner = (page_size, kv_heads) if layout == "NHD" else (kv_heads, page_size)
        self.data = _zeros((num_layers, num_pages, 2, *inner, head_dim), dtype, self.device)
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers

    def set_scales(self, k_scale: list[float], v_scale: list[float]) -> None:
        """Per-layer K and V scales (powers of two). Set them before anything is stored: stored values are
        not rescaled."""
        for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
            if len(scales) != self.num_layers:
                raise ValueError(f"{name}: {len(scales)} values for {self.num_layers} layers")
            for s in scales:
                if not (s > 0 and math.isfinite(s) and math.frexp(s)[0] == 0.5):
                    raise ValueError(f"{name} {s!r} is not a positive power of two")
        self.k_scale = [float(s) for s in k_scale]
        self.v_scale = [float(s) for s in v_scale]

    @property
    def store_limit(self) -> float:
        """The largest magnitude a stored value may take: the FP8 format's finite maximum, 0.0 (no clamp)
        for other dtypes."""
        return torch.finfo(self.dtype).max if self.is_fp8 else 0.0

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
        """One layer in the pool's own layout: [pages, 2, page_size, heads, D] (NHD) or [pages, 2, heads,
        page_size, D] (HND)."""
        return self.data[layer_id]

    def tokens_view(self, layer_id: int) -> torch.Tensor:
        """One layer as [pages, 2, page_size, heads, D] whatever the layout (a strided view for HND): kernels
        take their strides from it."""
        lay = self.data[layer_id]
        return lay if self.layout == "NHD" else lay.transpose(2, 3)

    def rows(self, layer_id: int) -> torch.Tensor:
        """NHD only: one layer as [pages * 2 * page_size, kv_heads, head_dim]: row (page*2 + kv)*page_size + slot.

        Indexing rows of this view is a plain gather; indexing (page, :, slot) of the 5-d layer instead
        makes torch move the whole layer, since the two indexed dims are not adjacent."""
        return self.data[layer_id].view(-1, self.kv_heads, self.head_dim)

    def slot_index(self, pages: torch.Tensor, offsets: torch.Tensor):
        """Where the tokens at (pages, offsets) (any matching shapes) live, for write() and read()."""
        if self.layout == "HND":
            return pages, offsets
        k = pages * (2 * self.page_size) + offsets
        return torch.stack([k, k + self.page_size], dim=-1)

    @property
    def is_fp8(self) -> bool:
        return self.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    def write(self, layer_id: int, index, k: torch.Tensor, v: torch.Tensor):
        """Store new tokens' K and V ([N, kv_heads, head_dim]) at `index` (slot_index of N tokens)."""
        ks, vs = self.k_scale[layer_id], self.v_scale[layer_id]
        if ks != 1.0 or vs != 1.0:
            k, v = k.float() * (1.0 / ks), v.float() * (1.0 / vs)
        kv = torch.stack([k, v], dim=1)
        if self.is_fp8:
            # Saturate: the cast itself turns values beyond the format's range into NaN.
            kv = kv.clamp(-self.store_limit, self.store_limit)
        kv = kv.to(self.dtype)
        if self.layout == "HND":
            pages, offsets = index
            self.tokens_view(layer_id)[pages, :, offsets] = kv
        else:
            self.rows(layer_id)[index.view(-1)] = kv.view(-1, self.kv_heads, self.head_dim)

    def read(self, layer_id: int, index) -> torch.Tensor:
        """K and V of the tokens at `index` (slot_index over a shape S) as stored, before their scales:
        [*S, 2, kv_heads, head_dim]."""
        if self.layout == "HND":
            pages, offsets = index
            return self.tokens_view(layer_id)[pages, :, offsets]
        rows = self.rows(layer_id)
        # index_select on flat indices is the fast gather on CPU; advanced indexing is several times slower.
        return rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])

    @classmethod
    def pages_for_budget(cls, budget_bytes: int, page_size: int, bytes_per_token: int) -> int:
        return max(0, budget_bytes // (page_size * bytes_per_token))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. In host memory it comes from calloc (through numpy): the OS maps zeroed pages as they
    are first written, so a pool of gigabytes costs nothing until used, where torch.zeros writes every byte
    before the worker can start (3 s for 1.9 GB on a 2-core machine)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)

