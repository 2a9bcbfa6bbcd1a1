"""Turns a step's chunks into flat device tensors, runs the model, and samples."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine.model import CausalLM
from engine.sampler import (SampleOutput, SamplingBatch, argmax_rows, draw_index, plain_draw, sample,
                            truncating_draw)
from engine.scheduler import Chunk
from kernels.attention import AttentionInputs


@dataclass
class PromptScores:
    """Prompt logprobs a step computed: for each request in `owners` (request, count), its next `count`
    prompt tokens' logprobs, and the top k at their positions (k: the most any of them asked for)."""
    owners: list[tuple[object, int]]
    logprobs: torch.Tensor  # [R] float32
    top_logprobs: torch.Tensor | None  # [R, k]
    top_ids: torch.Tensor | None  # [R, k]


# Rows of prompt logits made at a time: a whole chunk's would be [chunk, vocab] float32 (8192 x 128k: 4 GB).
# 128 rows and their log-softmax take what the logits of a 256-request decode batch take.
PROMPT_SCORE_ROWS = 128


@dataclass
class StepArrays:
    """A step's inputs on the host, before they are packed for the device (see AttentionInputs for the
    layout). Rows of `ids` listed in `fill_at` hold 0: their token is row `fill_from` of the previous step's
    sampled tokens, still on the device."""
    ids: np.ndarray  # int64 [N]
    positions: np.ndarray  # int64 [N]
    out_pages: np.ndarray  # int64 [N]
    out_offsets: np.ndarray  # int64 [N]
    logit_rows: np.ndarray  # int64 [S], the rows whose logits are sampled
    fill_at: np.ndarray  # int64 [F]
    fill_from: np.ndarray  # int64 [F]
    qo_indptr: np.ndarray  # int32 [B+1]
    kv_indptr: np.ndarray  # int32 [B+1]
    kv_indices: np.ndarray  # int32 [pages]
    last_len: np.ndarray  # int32 [B]
    seq_lens: np.ndarray  # int32 [B]
    prefix_lens: np.ndarray  # int32 [B]
    max_seq_len: int
    max_extend_len: int
    # Each sampled row's draw (engine.sampler.truncated_draw), for a graph that draws the tokens itself.
    temperature: np.ndarray  # float32 [S]
    seeds: np.ndarray  # int64 [S]
    draws: np.ndarray  # int64 [S]
    top_k: np.ndarray  # int64 [S]
    top_p: np.ndarray  # float32 [S]
    min_p: np.ndarray  # float32 [S]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return self.max_extend_len == 1


def _host_block(parts: list[np.ndarray], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """The arrays end to end in one host tensor (pinned if asked)."""
    out = torch.empty(sum(len(p) for p in parts), dtype=dtype, pin_memory=pin)
    np.concatenate(parts, out=out.numpy())
    return out


class ModelRunner:
    def __init__(self, model: CausalLM, pool, backend, device: torch.device, graphs=None):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.vocab = model.config.vocab_size
        self.graphs = graphs  # DecodeGraphs, or None for eager only
        # (logits, the tokens drawn from them) of the last step a graph ran, which sample() takes for a batch
        # whose draws depend on temperature alone instead of sampling the logits again.
        self._graph_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        # The last forward's prompt logprobs (params.prompt_logprobs), or None.
        self.prompt_scores: PromptScores | None = None

    def prepare(self, chunks: list[Chunk], prev_tokens: torch.Tensor | None = None):
        """Flat device inputs for a step: (input ids, positions, AttentionInputs, logit rows)."""
        return self.to_device(self.arrays(chunks), prev_tokens)

    def arrays(self, chunks: list[Chunk]) -> StepArrays:
        """The step's inputs on the host. A chunk that ends in a token still on the device (req.pending) takes
        its id from the previous step's sampled tokens (fill_at / fill_from), without a host round trip.
        Requests only add to lists and the arrays are made once for the batch: numpy calls per request took
        0.37 ms a step at batch 64 (9 us at batch 1) on a 2-core CPU, against 0.11 ms (7 us) this way."""
        ps = self.pool.page_size
        ids: list[int] = []
        qo, kv_ptr, starts, seq_lens, last_len, logit_rows = [0], [0], [], [], [], []
        fill_at, fill_from = [], []
        temps, seeds, draws, top_k, top_p, min_p = [], [], [], [], [], []
        page_lists = []
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
            page_lists.append(r.pages[:n_pages])
            qo.append(len(ids))
            kv_ptr.append(kv_ptr[-1] + n_pages)
            starts.append(s)
            seq_lens.append(e)
            last_len.append(e - (n_pages - 1) * ps)
            if c.samples:
                logit_rows.append(len(ids) - 1)
                temps.append(r.params.temperature)
                seeds.append(r.seed)
                draws.append(draw_index(r))
                top_k.append(r.params.top_k)
                top_p.append(r.params.top_p)
                min_p.append(r.params.min_p)
        b, n, nlog, nfill = len(chunks), len(ids), len(logit_rows), len(fill_at)
        kv = np.fromiter(itertools.chain.from_iterable(page_lists), dtype=np.int64, count=kv_ptr[-1])
        if n == b:  # one token a request (decode): at the chunk's start, in the request's last page
            longs = np.asarray(ids + starts + [p[-1] for p in page_lists] + [x % ps for x in starts] + logit_rows
                               + fill_at + fill_from, dtype=np.int64)
            ids_a, pos, out_pages, offsets = longs[:n], longs[n:2 * n], longs[2 * n:3 * n], longs[3 * n:4 * n]
            rest, max_extend = longs[4 * n:], 1
        else:  # token i of chunk c sits at position starts[c] + (i - qo[c])
            extend = np.diff(qo)
            row = np.repeat(np.arange(b), extend)
            pos = np.asarray(starts, dtype=np.int64)[row] + np.arange(n) - np.asarray(qo[:-1], dtype=np.int64)[row]
            out_pages = kv[np.asarray(kv_ptr[:-1], dtype=np.int64)[row] + pos // ps]
            rest = np.asarray(ids + logit_rows + fill_at + fill_from, dtype=np.int64)
            ids_a, rest, offsets, max_extend = rest[:n], rest[n:], pos % ps, int(extend.max())
        # One conversion for the int32 columns; each field is a view of it.
        ints = np.asarray(qo + kv_ptr + last_len + seq_lens + starts, dtype=np.int32)
        return StepArrays(ids_a, pos, out_pages, offsets, rest[:nlog], rest[nlog:nlog + nfill], rest[nlog + nfill:],
                          ints[:b + 1], ints[b + 1:2 * b + 2], kv.astype(np.int32), ints[2 * b + 2:3 * b + 2],
                          ints[3 * b + 2:4 * b + 2], ints[4 * b + 2:], max(seq_lens), max_extend,
                          np.asarray(temps, dtype=np.float32), np.asarray(seeds, dtype=np.int64),
                          np.asarray(draws, dtype=np.int64), np.asarray(top_k, dtype=np.int64),
                          np.asarray(top_p, dtype=np.float32), np.asarray(min_p, dtype=np.float32))

    def to_device(self, a: StepArrays, prev_tokens: torch.Tensor | None = None):
        """(input ids, positions, AttentionInputs, logit rows) on the device, for an eager step."""
        n, bsz, npages, nlog, nfill = len(a.ids), a.batch_size, len(a.kv_indices), len(a.logit_rows), len(a.fill_at)
        # Two host-to-device copies per step (one per dtype) instead of one per array, from pinned memory on a
        # GPU: an asynchronous copy out of pageable memory may wait for the stream first, and it leaves the
        # host buffer's lifetime to the driver's staging. torch's caching host allocator keeps a pinned buffer
        # until its copy has run.
        pin = self.device.type == "cuda"
        longs = _host_block([a.ids, a.positions, a.out_pages, a.out_offsets, a.logit_rows, a.fill_at, a.fill_from],
                            torch.int64, pin).to(self.device, non_blocking=True)
        ints = _host_block([a.qo_indptr, a.kv_indptr, a.kv_indices, a.last_len, a.seq_lens, a.prefix_lens],
                           torch.int32, pin).to(self.device, non_blocking=True)
        lo = np.cumsum([0, n, n, n, n, nlog, nfill, nfill])
        input_ids = longs[lo[0]:lo[1]]
        if nfill:
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
            max_seq_len=a.max_seq_len,
            max_extend_len=a.max_extend_len,
        )
        return input_ids, longs[lo[1]:lo[2]], attn, longs[lo[4]:lo[5]]

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [S, vocab] (float32) for the chunks that sample, in order; None if none does."""
        a = self.arrays(chunks)
        self._graph_tokens = None
        self.prompt_scores = None
        scored = _prompt_rows(chunks) if any(c.req.params.prompt_logprobs is not None for c in chunks) else None
        # A graph draws a token for every row: a step where a one-token chunk of a prompt samples nothing (a
        # small prefill budget beside decodes) runs eagerly, as does one that scores prompt tokens.
        if (self.graphs is not None and a.is_decode and scored is None and len(a.logit_rows) == a.batch_size
                and self.graphs.can_run(a.batch_size, a.max_seq_len)
                and (prev_tokens is None or prev_tokens.numel() <= self.graphs.sampled.numel())):
            if len(a.fill_at) and prev_tokens is None:
                raise RuntimeError("a chunk needs a token of the previous step, which is not in flight")
            logits, tokens = self.graphs.run(a, prev_tokens)
            if tokens is not None:
                self._graph_tokens = (logits, tokens)
            return logits
        input_ids, positions, attn, logit_rows = self.to_device(a, prev_tokens)
        step = self.backend.plan(attn)
        hidden = self.model(input_ids, positions, step)
        if scored is not None:
            self.prompt_scores = self._score_prompts(hidden, *scored)
        if logit_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden[logit_rows])

    def _score_prompts(self, hidden, rows: list[int], targets: list[int], owners, k: int) -> PromptScores:
        """The logprob of each target token under the logits of its row, and the top k there, from the model's
        own distribution, in slices of rows (every tensor-parallel rank runs the same slices)."""
        rows_t = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        targets_t = torch.tensor(targets, dtype=torch.long, device=hidden.device)
        lps, tops, ids = [], [], []
        for i in range(0, len(rows), PROMPT_SCORE_ROWS):
            lp = self.model.compute_logits(hidden[rows_t[i:i + PROMPT_SCORE_ROWS]]).log_softmax(dim=-1)
            lps.append(lp.gather(1, targets_t[i:i + PROMPT_SCORE_ROWS, None]).squeeze(1))
            if k:
                v, j = lp.topk(k, dim=-1)
                tops.append(v)
                ids.append(j)
        return PromptScores(owners, torch.cat(lps), torch.cat(tops) if k else None, torch.cat(ids) if k else None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs) -> SampleOutput:
        from_graph = self._graph_tokens is not None and self._graph_tokens[0] is logits
        if all(plain_draw(r) for r in reqs):
            # The graph that made these logits drew the tokens already (greedy or at each row's temperature).
            if from_graph:
                return SampleOutput(tokens=self._graph_tokens[1])
            if all(r.params.temperature == 0 for r in reqs):  # no parameters to move to the device
                return SampleOutput(tokens=argmax_rows(logits))
        elif from_graph and all(truncating_draw(r) for r in reqs):
            # Top-k / top-p / min-p: a second graph draws from these logits with the parameters the step staged.
            hot = [r.params for r in reqs if not r.params.greedy]  # (greedy rows ignore truncation)
            rules = (any(p.top_k > 0 for p in hot), any(p.top_p < 1.0 for p in hot), any(p.min_p > 0 for p in hot))
            tokens = self.graphs.draw_truncated(len(reqs), rules)
            if tokens is not None:
                return SampleOutput(tokens=tokens)
        return sample(logits, SamplingBatch.build(reqs, self.vocab, self.device))


def _prompt_rows(chunks: list[Chunk]):
    """(rows of the step's tokens whose logits score a prompt token, those tokens, [(request, count)], top k)
    for the chunks whose requests want prompt logprobs, or None. Position p of a prompt scores token p + 1;
    positions a launched step already scores (req.scored) are skipped, so a prompt computed again after a
    retraction is not scored twice."""
    rows, targets, owners, k, at = [], [], [], 0, 0
    for c in chunks:
        r = c.req
        if r.params.prompt_logprobs is not None:
            first, last = max(c.start, r.scored), min(c.start + c.length, r.prompt_len - 1)
            if last > first:
                rows.extend(range(at + first - c.start, at + last - c.start))
                targets.extend(r.prompt_ids[first + 1:last + 1])
                owners.append((r, last - first))
                r.scored = last
                k = max(k, r.params.prompt_logprobs)
        at += c.length
    return (rows, targets, owners, k) if rows else None
