"""A worker's first requests, its own, before it announces itself.

The first call of each kernel is slow: Triton compiles the prefill, sampling and page kernels on a fresh GPU
machine, FlashInfer JIT-compiles its wrappers (12-16 s on the H200), oneDNN builds its primitives on a CPU.
Left to the first client, that time lands in its time to first token, and on a prefill worker it can outlast
the decode worker's wait for the KV (--transfer-timeout), failing the request. Two short requests together, one
greedy and one sampled with logprobs and every truncation, then a greedy one alone, take those first calls here
instead.

It goes through the engine's own API, so a tensor-parallel worker's ranks all run it (engine/tp_worker.py);
the prefix cache is flushed and its counters zeroed after, so nothing of it is visible to the coordinators.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

GREEDY = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
LONE = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
SAMPLED = {"max_tokens": 3, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "logprobs": 2,
           "seed": 0, "ignore_eos": True}  # seeded: the engine's generator of seeds is not drawn from


def warm_up(engine) -> float:
    """Run the warm-up requests to their end; the seconds it took."""
    t0 = time.perf_counter()
    page = engine.args.page_size
    vocab = engine.config.vocab_size
    # Two pages and a part: a full page and a partial one, prompts of different lengths in one batch (as far
    # as a short context leaves room for them and their tokens).
    room = engine.max_model_len - GREEDY["max_tokens"] - 1
    prompts = [[(7 * i + 3) % vocab for i in range(min(n, room))] for n in (2 * page + 3, page + 1)]
    reqs = [engine.add_request(p, dict(params), rid=f"warmup-{i}", detokenize=False)
            for i, (p, params) in enumerate(zip(prompts, (GREEDY, SAMPLED)))]
    _run(engine)
    # A prompt alone, greedy, of whole pages: the shape of many a first request, and a batch of one takes
    # paths of its own (attention with nothing before it and no mask; greedy-only sampling; on a GPU, kernels
    # that Triton specializes for lengths divisible by 16).
    lone = [(5 * i + 11) % vocab for i in range(min(2 * page, room))]
    reqs.append(engine.add_request(lone, dict(LONE), rid="warmup-lone", detokenize=False))
    _run(engine)
    if any(r.num_output != r.params.max_tokens for r in reqs):
        raise RuntimeError(f"the warm-up requests did not finish: {[r.num_output for r in reqs]} tokens")
    engine.flush_cache()
    if engine.cache is not None:
        engine.cache.query_tokens = engine.cache.hit_tokens = 0
    engine.check()
    dt = time.perf_counter() - t0
    logger.info("warmed up in %.2fs", dt)
    return dt


def _run(engine) -> None:
    while engine.has_work():
        engine.step()
