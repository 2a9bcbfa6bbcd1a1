"""Turns a step's chunks into flat device tensors, runs the model, and samples."""

from __future__ import annotations

import numpy as np
import torch

from engine.model import CausalLM
from engine.sampler import SampleOutput, SamplingBatch, sample
from engine.scheduler import Chunk
from kernels.attention import AttentionInputs


class ModelRunner:
    def __init__(self, model: CausalLM, pool, backend, device: torch.device, graphs=None):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.vocab = model.config.vocab_size
        self.graphs = graphs  # DecodeGraphs, or None for eager only

    def prepare(self, chunks: list[Chunk]):
        ps = self.pool.page_size
        ids: list[int] = []
        positions, out_pages = [], []
        qo, kv_ptr, kv_idx = [0], [0], []
        seq_lens, prefix_lens, last_len, logit_rows = [], [], [], []
        for c in chunks:
            r, s, e = c.req, c.start, c.start + c.length
            ids.extend(r.tokens[s:e])
            n_pages = -(-e // ps)
            pages = np.asarray(r.pages[:n_pages], dtype=np.int64)
            pos = np.arange(s, e, dtype=np.int64)
            positions.append(pos)
            out_pages.append(pages[pos // ps])
            kv_idx.append(pages)
            qo.append(qo[-1] + c.length)
            kv_ptr.append(kv_ptr[-1] + n_pages)
            seq_lens.append(e)
            prefix_lens.append(s)
            last_len.append(e - (n_pages - 1) * ps)
            if c.samples:
                logit_rows.append(qo[-1] - 1)
        pos = np.concatenate(positions)
        dev = self.device

        def i32(x):
            return torch.from_numpy(np.asarray(x, dtype=np.int32)).to(dev, non_blocking=True)

        def i64(x):
            return torch.from_numpy(np.asarray(x, dtype=np.int64)).to(dev, non_blocking=True)

        attn = AttentionInputs(
            qo_indptr=i32(qo),
            kv_indptr=i32(kv_ptr),
            kv_indices=i32(np.concatenate(kv_idx)),
            kv_last_page_len=i32(last_len),
            seq_lens=i32(seq_lens),
            prefix_lens=i32(prefix_lens),
            out_pages=i64(np.concatenate(out_pages)),
            out_offsets=i64(pos % ps),
            max_seq_len=max(seq_lens),
            max_extend_len=max(c.length for c in chunks),
        )
        return i64(ids), i64(pos), attn, i64(logit_rows)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor | None:
        """Logits [S, vocab] (float32) for the chunks that sample, in order; None if none does."""
        input_ids, positions, attn, logit_rows = self.prepare(chunks)
        if self.graphs is not None and attn.is_decode and self.graphs.can_run(len(chunks), attn.max_seq_len):
            return self.graphs.run(input_ids, positions, attn)
        step = self.backend.plan(attn)
        hidden = self.model(input_ids, positions, step)
        if logit_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden[logit_rows])

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs) -> SampleOutput:
        return sample(logits, SamplingBatch.build(reqs, self.vocab, self.device))
