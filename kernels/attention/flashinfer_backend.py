"""FlashInfer's paged attention (GPU only). Our pool's per-layer layouts, [pages, 2, page_size, kv_heads,
head_dim] and [pages, 2, kv_heads, page_size, head_dim], are FlashInfer's single-tensor NHD and HND layouts,
so pages are used in place. Decode-only steps use the
decode wrapper; steps with prefill chunks (mixed with decodes or not) the prefill wrapper, whose causal mask
is aligned to the end of each request's KV, as ours is."""

from __future__ import annotations

import torch

from kernels.attention.base import AttentionBackend, AttentionInputs, AttentionStep

_WORKSPACE_BYTES = 256 << 20
# Query heads per KV head that FlashInfer's decode kernel is compiled for in every release we know of. 0.7.2
# raised "Unsupported group_size: 7" at the first decode step of the Qwen2.5-0.5B shape (14 query heads, 2 KV
# heads) on an H200, which stopped the worker mid-request; such models are refused when the backend is made.
DECODE_GROUP_SIZES = (1, 2, 4, 8)
# Head sizes FlashInfer's kernels are built for. Its FA2 prefill does not check the size: 32 raised "Invalid
# configuration" at the first prefill on an H100 (stopping the worker), and sizes that are not a multiple of 64
# are reported upstream to fault or to return wrong values without an error.
HEAD_DIMS = (64, 128, 256)


def check_supported(config) -> None:
    """Raise ValueError, naming the alternative, for a model FlashInfer's kernels cannot run."""
    if config.head_dim not in HEAD_DIMS:
        raise ValueError(f"the flashinfer backend runs head sizes {list(HEAD_DIMS)}; this model's is "
                         f"{config.head_dim}: use --attention-backend triton")
    group = config.num_attention_heads // config.num_key_value_heads
    if group not in DECODE_GROUP_SIZES:
        raise ValueError(f"the flashinfer backend decodes {list(DECODE_GROUP_SIZES)} query heads per KV head; "
                         f"this model has {group} ({config.num_attention_heads} / {config.num_key_value_heads}): "
                         "use --attention-backend triton")


class FlashInferBackend(AttentionBackend):
    def __init__(self, pool, config, dtype=None):
        check_supported(config)
        super().__init__(pool, config, dtype)
        import flashinfer

        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, pool.layout)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, pool.layout)

    def plan(self, x: AttentionInputs) -> AttentionStep:
        c = self.config
        common = dict(window_left=(c.sliding_window - 1) if c.sliding_window else -1,
                      q_data_type=self.dtype, kv_data_type=self.pool.dtype, sm_scale=c.head_dim ** -0.5)
        shape = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.pool.page_size)
        if x.is_decode:
            self.decode.plan(x.kv_indptr, x.kv_indices, x.kv_last_page_len, *shape, **common)
            wrapper = self.decode
        else:
            self.prefill.plan(x.qo_indptr, x.kv_indptr, x.kv_indices, x.kv_last_page_len, *shape, causal=True,
                              **common)
            wrapper = self.prefill
        return _FlashInferStep(self.pool, wrapper, x)


class _FlashInferStep(AttentionStep):
    def __init__(self, pool, wrapper, x: AttentionInputs):
        self.pool = pool
        self.wrapper = wrapper
        self.x = x

    def attend(self, q, layer_id):
        return self.wrapper.run(q, self.pool.layer(layer_id), k_scale=self.pool.k_scale[layer_id],
                                v_scale=self.pool.v_scale[layer_id])
