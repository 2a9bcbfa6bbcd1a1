"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed with padded inputs.

A decode step of a small model is mostly kernel-launch overhead; a graph launches the whole forward at once.
Captured: the model forward, the LM head and each row's token (kernels/step_tokens.py: greedy, or drawn at the
row's temperature) over static input buffers. Replay copies the step's inputs into those buffers (padding the
batch up to the bucket) and runs the graph; a batch whose draws depend on temperature alone takes the graph's
tokens (engine.sampler.plain_draw), any other is sampled from the logits outside it.

Static layout for bucket b (rows past the real batch are padding):
    ids, positions      [b]           padding: token 0 at position 0
    fill_source         [b]           the row of `sampled` whose token a row waits for, or -1
    seeds, draws        [b]           each row's draw: its seed, the index of the token drawn
    top_k               [b]           padding: 0 (none)
    temperature         [b]           float32; padding: 0 (greedy)
    top_p, min_p        [b]           float32; padding: 1, 0 (none)
    out_pages/offsets   [b]           padding: page 0, slot 0 (the reserved page; what lands there is unread)
    kv_indptr           [b+1]         padding requests own one page each, page 0
    kv_indices          [b * max_pages]
    seq_lens            [b]           padding: 1
The attention step is planned for `max_context` tokens, so contexts beyond it take the eager path, as do
steps where a row samples nothing (a one-token prompt chunk beside decodes): a graph draws for every row.
Only backends that plan without host synchronisation (triton) can be captured.

The static buffers are views of one block, the int64 fields first and the page list last. A step fills its
host mirror (pinned; two of them, used in turn, so that the host writes one while the copy of the other may
still wait behind the step in flight) and moves it in one copy, rather than a copy per buffer or per dtype:
at batch 1 the host's work for a step is most of what a small model's step costs.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.sampler import truncated_draw
from kernels.step_tokens import counters_for, fill_tokens, sample_tokens
from kernels.attention import AttentionInputs

logger = logging.getLogger(__name__)


def buckets(max_bs: int) -> list[int]:
    out = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({b for b in out if b <= max_bs} | {max_bs})


class DecodeGraphs:
    # Whether graphs end in each row's token. It costs a few microseconds in steps that sample otherwise
    # (top-p, penalties, logprobs), and saves about 23 us of small kernels after every greedy step (0.5B on an
    # H200, runs Z35-Z36) and the whole sampler after a step that only sets temperatures.
    argmax = True

    def __init__(self, model, pool, backend, max_bs: int, max_context: int, max_rows: int | None = None):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.max_bs = max_bs
        self.max_context = max_context
        self.max_pages = -(-max_context // pool.page_size)
        dev = pool.device
        mb = max_bs
        # One int32 block: the int64 fields first (as pairs of int32), then the int32 ones, so that one copy
        # moves a step's inputs.
        self._at = 16 * mb  # where the int32 fields start, in int32 words
        self.block = torch.zeros(self._at + 8 * mb + 2 + mb * self.max_pages, dtype=torch.int32, device=dev)
        self.longs, self.ints = self.block[: self._at].view(torch.int64), self.block[self._at:]
        (self.ids, self.positions, self.out_pages, self.out_offsets, self.fill_source, self.seeds,
         self.draws, self.top_k) = self.longs.split(mb)
        # The last step's tokens, which the next step's graph fills into its ids: the greedy tokens a graph
        # chose are written here; a step sampled otherwise has its tokens copied here first. That step may be
        # an eager one with more rows than the largest graph (a prefill beside many decodes), hence max_rows:
        # the most tokens a step samples (the running-request limit).
        self.sampled = torch.zeros(max(mb, max_rows or 0), dtype=torch.int64, device=dev)
        (self.qo_indptr, self.kv_indptr, self.last_len, self.seq_lens, self.prefix_lens, temperature, top_p,
         min_p, self.kv_indices) = self.ints.split([mb + 1, mb + 1, mb, mb, mb, mb, mb, mb, mb * self.max_pages])
        self.temperature, self.top_p, self.min_p = (t.view(torch.float32) for t in (temperature, top_p, min_p))
        self._temp_at = 5 * mb + 2  # then top_p and min_p
        self._kv_at = 8 * mb + 2  # where the page list starts in the int32 block
        pin = dev.type == "cuda"
        self._mirrors = [torch.zeros(self.block.shape[0], dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        for h in self._mirrors:
            h[self._at: self._at + mb + 1] = torch.arange(mb + 1, dtype=torch.int32)  # qo_indptr: one token each
        # The last copy out of each mirror, recorded again at each use.
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._turn = 0
        self.qo_indptr.copy_(self._mirrors[0][self._at: self._at + mb + 1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor | None] = {}
        self._argmax_counters = counters_for(mb, dev) if self.argmax else None
        self.mempool = None
        # Per bucket: the graph that draws truncated tokens (top-k, top-p, min-p) from the decode graph's
        # logits, captured on first use; False where capturing failed (those steps sample eagerly).
        self.truncating: dict[tuple, torch.cuda.CUDAGraph | bool] = {}
        self._bucket = 0  # the bucket of the last replay

    def _inputs(self, b: int) -> AttentionInputs:
        return AttentionInputs(self.qo_indptr[: b + 1], self.kv_indptr[: b + 1], self.kv_indices,
                               self.last_len[:b], self.seq_lens[:b], self.prefix_lens[:b], self.out_pages[:b],
                               self.out_offsets[:b], self.max_context, 1)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = self.backend.plan(self._inputs(b))
        fill_tokens(self.ids[:b], self.fill_source[:b], self.sampled)
        logits = self.model.compute_logits(self.model(self.ids[:b], self.positions[:b], step))
        if self._argmax_counters is None:
            return logits, None
        return logits, sample_tokens(logits, self._argmax_counters, self.temperature[:b], self.seeds[:b],
                                     self.draws[:b], out=self.sampled[:b])

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
                self.logits[b], self.tokens[b] = self._forward(b)
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
            self.fill_source[n:b] = -1
            self.seeds[n:b] = 0
            self.draws[n:b] = 0
            self.temperature[n:b] = 0.0
            self.top_k[n:b] = 0
            self.top_p[n:b] = 1.0
            self.min_p[n:b] = 0.0
            self.seq_lens[n:b] = 1
            self.last_len[n:b] = 1

    def stage(self, a, prev_tokens: torch.Tensor | None) -> int:
        """Put a decode step's inputs (engine.runner.StepArrays) in the static buffers, padded to the bucket;
        returns the bucket. Padding requests are token 0 at position 0, each owning one page, page 0 (the
        reserved page; what lands there is unread), listed after the real pages."""
        n, nnz, nfill = a.batch_size, len(a.kv_indices), len(a.fill_at)
        if len(a.temperature) != n:
            raise ValueError(f"a graph step samples every row: {n} rows, {len(a.temperature)} sampled")
        b = next(s for s in sorted(self.graphs or buckets(self.max_bs)) if s >= n)
        mb = self.max_bs
        h = self._mirrors[self._turn]
        if self._copied is not None:
            self._copied[self._turn].synchronize()  # its last copy has run (long since, as a rule)
        v64, v32 = h[: self._at].view(torch.int64).numpy(), h[self._at:].numpy()
        for i, col in enumerate((a.ids, a.positions, a.out_pages, a.out_offsets)):
            v64[i * mb: i * mb + n] = col
            v64[i * mb + n: i * mb + b] = 0
        v64[4 * mb: 4 * mb + b] = -1
        v64[4 * mb + a.fill_at] = a.fill_from
        for i, col in ((5, a.seeds), (6, a.draws), (7, a.top_k)):
            v64[i * mb: i * mb + n] = col
            v64[i * mb + n: i * mb + b] = 0
        v32[mb + 1: mb + 2 + n] = a.kv_indptr
        v32[mb + 2 + n: mb + 2 + b] = np.arange(nnz + 1, nnz + b - n + 1, dtype=np.int32)
        for i, (col, pad) in enumerate(((a.last_len, 1), (a.seq_lens, 1), (a.prefix_lens, 0))):
            at = 2 * mb + 2 + i * mb
            v32[at: at + n] = col
            v32[at + n: at + b] = pad
        for i, (col, pad) in enumerate(((a.temperature, 0.0), (a.top_p, 1.0), (a.min_p, 0.0))):
            f = v32[self._temp_at + i * mb: self._temp_at + i * mb + b].view(np.float32)
            f[:n] = col
            f[n:] = pad
        v32[self._kv_at: self._kv_at + nnz] = a.kv_indices
        v32[self._kv_at + nnz: self._kv_at + nnz + b - n] = 0
        end = self._at + self._kv_at + nnz + b - n
        self.block[:end].copy_(h[:end], non_blocking=True)
        if self._copied is not None:
            self._copied[self._turn].record()
        self._turn ^= 1
        if nfill and prev_tokens.data_ptr() != self.sampled.data_ptr():
            if prev_tokens.numel() > self.sampled.numel():
                raise ValueError(f"the previous step sampled {prev_tokens.numel()} tokens; a graph step can take "
                                 f"them from at most {self.sampled.numel()}")
            self.sampled[: prev_tokens.numel()].copy_(prev_tokens)  # (the graph reads them from there)
        return b

    @torch.inference_mode()
    def run(self, a, prev_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [batch, vocab] of a decode step (engine.runner.StepArrays), and each row's greedy token
        [batch] (None without `argmax`). Both are the graph's own buffers, rewritten by its next replay."""
        b = self.stage(a, prev_tokens)
        self.graphs[b].replay()
        self._bucket = b
        tokens = self.tokens[b]
        return self.logits[b][: a.batch_size], None if tokens is None else tokens[: a.batch_size]

    def _truncated(self, b: int, rules: tuple[bool, bool, bool] = (True, True, True)) -> None:
        tokens = truncated_draw(self.logits[b], self.temperature[:b], self.top_k[:b], self.top_p[:b],
                                self.min_p[:b], self.seeds[:b], self.draws[:b], *rules)
        self.sampled[:b].copy_(tokens)

    @torch.inference_mode()
    def draw_truncated(self, n: int, rules: tuple[bool, bool, bool] = (True, True, True)) -> torch.Tensor | None:
        """The last replay's first n tokens drawn again after each row's top-k, top-p and min-p
        (engine.sampler.truncated_draw), into `sampled`, by a graph of its own: eagerly that is some twenty
        small launches after every step, which made a top-p 0.5B step host-bound. `rules`: whether any row
        asks for top-k, top-p, min-p; a graph per bucket and rules, so that a top-p batch runs no top-k
        passes. None if that graph could not be captured (the caller samples eagerly)."""
        key = (self._bucket, rules)
        g = self.truncating.get(key)
        if g is None:
            g = self.truncating[key] = self._capture_truncated(*key)
        if g is False:
            return None
        g.replay()
        return self.sampled[:n]

    def _capture_truncated(self, b: int, rules: tuple[bool, bool, bool]) -> "torch.cuda.CUDAGraph | bool":
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._truncated(b, rules)  # compiles the kernels outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.mempool):
                self._truncated(b, rules)
        except RuntimeError as e:  # (out of memory, or an operation that cannot be captured)
            logger.warning("no truncated-sampling graph for batch size %d: %s; sampling eagerly", b, e)
            return False
        return g
