"""Reference attention in plain torch: gathers each request's pages into a padded [B, L] view and runs SDPA.

It runs on any device and is the yardstick for the Triton and FlashInfer backends. The padding is internal:
callers still speak the flat paged layout of `AttentionInputs`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend, AttentionInputs, AttentionStep


class TorchBackend(AttentionBackend):
    def plan(self, inputs: AttentionInputs) -> AttentionStep:
        return _TorchStep(self, inputs)


class _TorchStep(AttentionStep):
    def __init__(self, backend: TorchBackend, x: AttentionInputs):
        pool = backend.pool
        self.pool = pool
        self.x = x
        self.scale = backend.config.head_dim ** -0.5
        dev = pool.device
        ps = pool.page_size
        bsz, kv_len, q_len = x.batch_size, x.max_seq_len, x.max_extend_len
        n_pages = (x.kv_indptr[1:] - x.kv_indptr[:-1]).long()
        max_pages = (kv_len + ps - 1) // ps
        table = torch.zeros(bsz, max_pages, dtype=torch.long, device=dev)
        table[torch.arange(max_pages, device=dev)[None, :] < n_pages[:, None]] = x.kv_indices.long()
        j = torch.arange(kv_len, device=dev)
        # Where every padded KV position ([B, L]) lives; padding points at the reserved zero page.
        self.gather_index = pool.slot_index(table.gather(1, (j // ps)[None, :].expand(bsz, -1)),
                                            (j % ps)[None, :].expand(bsz, -1))

        i = torch.arange(q_len, device=dev)
        q_pos = x.prefix_lens.long()[:, None] + i[None, :]  # [B, Qmax] absolute position of each query
        mask = (j[None, None, :] < x.seq_lens.long()[:, None, None]) & (j[None, None, :] <= q_pos[:, :, None])
        window = backend.config.sliding_window
        if window is not None:
            mask &= (q_pos[:, :, None] - j[None, None, :]) < window
        # Padding query rows see key 0 so no softmax row is empty; their outputs are dropped.
        mask[..., 0] |= ~mask.any(-1)
        self.mask = mask[:, None]  # [B, 1, Qmax, L]

        extend = (x.qo_indptr[1:] - x.qo_indptr[:-1]).long()
        owner = torch.repeat_interleave(torch.arange(bsz, device=dev), extend)
        within = torch.arange(x.num_tokens, device=dev) - x.qo_indptr.long()[owner]
        self.q_index = owner * q_len + within  # flat token -> row of the padded [B*Qmax] view
        self.dense = q_len == 1 or bool((extend == q_len).all())
        # One prompt with nothing cached before it (the usual first chunk): plain causal attention, which SDPA
        # computes without reading a mask and skipping the masked half (1.46x on a 1024-token chunk, CPU).
        self.causal = bsz == 1 and q_len == kv_len and window is None and int(x.prefix_lens[0]) == 0

    def attend(self, q, layer_id):
        x = self.x
        kv = self.pool.read(layer_id, self.gather_index)  # [B, L, 2, Hkv, D]
        keys, values = kv.to(q.dtype).unbind(2)  # [B, L, Hkv, D]
        ks, vs = self.pool.k_scale[layer_id], self.pool.v_scale[layer_id]
        if ks != 1.0 or vs != 1.0:
            keys, values = keys * ks, values * vs
        bsz, q_len = x.batch_size, x.max_extend_len
        heads, dim = q.shape[1], q.shape[2]
        if self.dense:
            qp = q.view(bsz, q_len, heads, dim)
        else:
            qp = q.new_zeros(bsz * q_len, heads, dim)
            qp[self.q_index] = q
            qp = qp.view(bsz, q_len, heads, dim)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=None if self.causal else self.mask, is_causal=self.causal, scale=self.scale, enable_gqa=True,
        )
        out = out.transpose(1, 2).reshape(bsz * q_len, heads, dim)
        return out if self.dense else out[self.q_index]
