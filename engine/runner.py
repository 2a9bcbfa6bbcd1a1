"""Turns a step's chunks into flat device tensors, runs the model, and samples."""

from __future__ import annotations

import numpy as np
import torch

from engine.model import CausalLM
from engine.sampler import SampleOutput, SamplingBatch, argmax_rows, sample
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

    def prepare(self, chunks: list[Chunk], prev_tokens: torch.Tensor | None = None):
        """Flat device inputs for a step. A chunk that ends in a token still on the device (req.pending) takes
        its id from `prev_tokens`, the previous step's sampled tokens, without a host round trip."""
        ps = self.pool.page_size
        ids: list[int] = []
        positions, out_pages = [], []
        qo, kv_ptr, kv_idx = [0], [0], []
        seq_lens, prefix_lens, last_len, logit_rows = [], [], [], []
        fill_at, fill_from = [], []
        for c in chunks:
            r, s, e = c.req, c.start, c.start + c.length
            ids.extend(r.tokens[s:e])
            if e > len(r.tokens):
                if e - len(r.tokens) > 1 or r.pending != 1:
                    raise RuntimeError(f"request {r.rid}: {e - len(r.tokens)} tokens asked beyond the known ones, "
                                       f"{r.pending} pending")
                fill_at.append(len(ids))
                fill_from.append(r.pending_row)
                ids.append(0)
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
        n, bsz, npages = len(ids), len(chunks), kv_ptr[-1]
        # Two host-to-device copies per step (one per dtype) instead of one per array.
        longs = torch.from_numpy(np.concatenate([np.asarray(ids, dtype=np.int64), pos, np.concatenate(out_pages),
                                                 pos % ps, np.asarray(logit_rows, dtype=np.int64),
                                                 np.asarray(fill_at + fill_from, dtype=np.int64)]))
        ints = torch.from_numpy(np.concatenate([np.asarray(qo, dtype=np.int32), np.asarray(kv_ptr, dtype=np.int32),
                                                np.concatenate(kv_idx).astype(np.int32),
                                                np.asarray(last_len + seq_lens + prefix_lens, dtype=np.int32)]))
        longs = longs.to(self.device, non_blocking=True)
        ints = ints.to(self.device, non_blocking=True)
        lo = np.cumsum([0, n, n, n, n, len(logit_rows), len(fill_at), len(fill_at)])
        input_ids = longs[lo[0]:lo[1]]
        if fill_at:
            if prev_tokens is None:
                raise RuntimeError("a chunk needs a token of the previous step, which is not in flight")
            input_ids.index_copy_(0, longs[lo[5]:lo[6]], prev_tokens.index_select(0, longs[lo[6]:lo[7]]))
        io = np.cumsum([0, bsz + 1, bsz + 1, npages, bsz, bsz, bsz])
        attn = AttentionInputs(
            qo_indptr=ints[io[0]:io[1]],
            kv_indptr=ints[io[1]:io[2]],
            kv_indices=ints[io[2]:io[3]],
            kv_last_page_len=ints[io[3]:io[4]],
            seq_lens=ints[io[4]:io[5]],
            prefix_lens=ints[io[5]:io[6]],
            out_pages=longs[lo[2]:lo[3]],
            out_offsets=longs[lo[3]:lo[4]],
            max_seq_len=max(seq_lens),
            max_extend_len=max(c.length for c in chunks),
        )
        return input_ids, longs[lo[1]:lo[2]], attn, longs[lo[4]:lo[5]]

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [S, vocab] (float32) for the chunks that sample, in order; None if none does."""
        input_ids, positions, attn, logit_rows = self.prepare(chunks, prev_tokens)
        if self.graphs is not None and attn.is_decode and self.graphs.can_run(len(chunks), attn.max_seq_len):
            return self.graphs.run(input_ids, positions, attn)
        step = self.backend.plan(attn)
        hidden = self.model(input_ids, positions, step)
        if logit_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden[logit_rows])

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs) -> SampleOutput:
        if all(r.params.temperature == 0 and not r.params.has_penalties and r.params.logprobs is None
               and r.num_output + r.pending >= r.params.min_tokens for r in reqs):
            # Plain greedy batch: no parameters to move to the device.
            return SampleOutput(tokens=argmax_rows(logits))
        return sample(logits, SamplingBatch.build(reqs, self.vocab, self.device))
