"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed with padded inputs.

A decode step of a small model is mostly kernel-launch overhead; a graph launches the whole forward at once.
Captured: the model forward and the LM head over static input buffers. Replay copies the step's inputs into
those buffers (padding the batch up to the bucket) and runs the graph; sampling stays outside.

Static layout for bucket b (rows past the real batch are padding):
    ids, positions      [b]           padding: token 0 at position 0
    out_pages/offsets   [b]           padding: page 0, slot 0 (the reserved page; what lands there is unread)
    kv_indptr           [b+1]         padding requests own one page each, page 0
    kv_indices          [b * max_pages]
    seq_lens            [b]           padding: 1
The attention step is planned for `max_context` tokens, so contexts beyond it take the eager path.
Only backends that plan without host synchronisation (triton) can be captured.
"""

from __future__ import annotations

import logging

import torch

from kernels.attention import AttentionInputs

logger = logging.getLogger(__name__)


def buckets(max_bs: int) -> list[int]:
    out = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({b for b in out if b <= max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, model, pool, backend, max_bs: int, max_context: int):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.max_bs = max_bs
        self.max_context = max_context
        self.max_pages = -(-max_context // pool.page_size)
        dev = pool.device
        i32 = dict(dtype=torch.int32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        self.ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.out_pages = torch.zeros(max_bs, **i64)
        self.out_offsets = torch.zeros(max_bs, **i64)
        self.qo_indptr = torch.arange(max_bs + 1, **i32)
        self.kv_indptr = torch.zeros(max_bs + 1, **i32)
        self.kv_indices = torch.zeros(max_bs * self.max_pages, **i32)
        self.last_len = torch.ones(max_bs, **i32)
        self.seq_lens = torch.ones(max_bs, **i32)
        self.prefix_lens = torch.zeros(max_bs, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.mempool = None

    def _inputs(self, b: int) -> AttentionInputs:
        return AttentionInputs(self.qo_indptr[: b + 1], self.kv_indptr[: b + 1], self.kv_indices,
                               self.last_len[:b], self.seq_lens[:b], self.prefix_lens[:b], self.out_pages[:b],
                               self.out_offsets[:b], self.max_context, 1)

    def _forward(self, b: int) -> torch.Tensor:
        step = self.backend.plan(self._inputs(b))
        return self.model.compute_logits(self.model(self.ids[:b], self.positions[:b], step))

    @torch.inference_mode()
    def capture(self) -> None:
        self._pad(0, self.max_bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Compile and autotune outside the capture, for every bucket: kernels may pick a different
            # variant (or configuration) by batch size.
            for b in [self.max_bs] + buckets(self.max_bs):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        for b in sorted(buckets(self.max_bs), reverse=True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.mempool):
                self.logits[b] = self._forward(b)
            if self.mempool is None:
                self.mempool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s (contexts up to %d)", sorted(self.graphs),
                    self.max_context)

    def can_run(self, batch: int, max_seq_len: int) -> bool:
        return batch <= self.max_bs and max_seq_len <= self.max_context

    def _pad(self, n: int, b: int) -> None:
        if b > n:
            self.ids[n:b] = 0
            self.positions[n:b] = 0
            self.out_pages[n:b] = 0
            self.out_offsets[n:b] = 0
            self.seq_lens[n:b] = 1
            self.last_len[n:b] = 1

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, x: AttentionInputs) -> torch.Tensor:
        n = ids.shape[0]
        b = next(s for s in sorted(self.graphs) if s >= n)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.out_pages[:n].copy_(x.out_pages)
        self.out_offsets[:n].copy_(x.out_offsets)
        self.seq_lens[:n].copy_(x.seq_lens)
        self.last_len[:n].copy_(x.kv_last_page_len)
        nnz = x.kv_indices.shape[0]
        self.kv_indices[:nnz].copy_(x.kv_indices)
        self.kv_indptr[: n + 1].copy_(x.kv_indptr)
        if b > n:
            self._pad(n, b)
            # Each padding request owns one page: page 0, listed after the real pages.
            self.kv_indices[nnz: nnz + b - n] = 0
            self.kv_indptr[n + 1: b + 1] = torch.arange(nnz + 1, nnz + b - n + 1, dtype=torch.int32,
                                                        device=self.kv_indptr.device)
        self.graphs[b].replay()
        return self.logits[b][:n]
