"""Copy a request's pages between two KV pools (same layout) for every layer in one launch.

Pools are [layers, pages, 2, page_size, kv_heads, head_dim]; one (layer, page) block is contiguous. Program
(l, i, c) copies chunk c of block (l, src_pages[i]) to block (l, dst_pages[i]). The destination may be
another process's pool opened through CUDA IPC. A pair whose source page is negative is skipped: padding, so
that a captured copy of a fixed list length serves any shorter list.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Elements each program copies, and its warps: the fastest of bench/transfers.py's sweep in runs P and P2 on an
# H200 (0.321 and 0.325 ms for 4096 tokens of 8B KV; the slowest setting took 0.37 ms).
CHUNK = 2048
WARPS = 8


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor,
               fused: bool | None = None) -> None:
    """dst[:, dst_pages[i]] = src[:, src_pages[i]] for all i (index tensors on the pools' device)."""
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
        raise ValueError(f"pool layouts differ: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}")
    if src_pages.numel() != dst_pages.numel():
        raise ValueError("source and destination page lists differ in length")
    n = src_pages.numel()
    if n == 0:
        return
    use = triton is not None and (fused or (fused is None and src.is_cuda))
    if not use:
        dst.index_copy_(1, dst_pages.long(), src.index_select(1, src_pages.long()))
        return
    block = src[0, 0].numel()
    layers = src.shape[0]
    _page_copy_kernel[(layers, n, triton.cdiv(block, CHUNK))](
        src, dst, src_pages, dst_pages, src.stride(0), dst.stride(0), block, BLOCK=CHUNK, num_warps=WARPS)


if triton is not None:
    @triton.jit
    def _page_copy_kernel(SRC, DST, src_pages, dst_pages, src_layer_stride, dst_layer_stride, block,
                          BLOCK: tl.constexpr):
        layer = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1)
        chunk = tl.program_id(2)
        sp = tl.load(src_pages + i).to(tl.int64)
        dp = tl.load(dst_pages + i).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < block
        if sp >= 0:
            x = tl.load(SRC + layer * src_layer_stride + sp * block + offs, mask=mask)
            tl.store(DST + layer * dst_layer_stride + dp * block + offs, x, mask=mask)
