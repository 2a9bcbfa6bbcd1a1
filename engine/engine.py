"""The worker core: model, KV pool, scheduler and sampler behind add_request / step / abort."""

from __future__ import annotations

import json
import logging
import os
import hashlib
import random
import time
import uuid

from dataclasses import dataclass

import torch

from engine.args import EngineArgs
from engine.config import ModelConfig, read_json
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_scales import kv_scales
from engine.loader import load_model, quantized_already, resolve_model_dir
from engine.model import CausalLM
from engine.parallel import init_tensor_parallel
from engine.request import Logprob, Request, Status
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.tokenizer import Tokenizer
from engine.weights import checkpoint_digest
from kernels.attention import create_backend, default_backend
from kvstore import KVPool, PageAllocator, RadixCache, kv_bytes_per_token

logger = logging.getLogger(__name__)


@dataclass
class _Inflight:
    step: int
    reqs: list[Request]  # the requests that sample, in the order of out's rows
    out: object  # SampleOutput on the device
    host: list  # its tensors' copies on their way to the host
    event: object  # torch.cuda.Event recorded after the copies (None on the CPU)
    # Prompt logprobs the step computed: (owners, [logprobs, top logprobs, top ids] on their way to the host).
    prompt: tuple | None = None


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A snapshot of a step's output on its way to the host (on a CPU .to("cpu") would not copy)."""
    if t is None:
        return None
    return t.to("cpu", non_blocking=True) if t.is_cuda else t.clone()


def weights_digest(model_dir: str, args: EngineArgs) -> str:
    """What a peer must match to exchange KV with this engine (engine/weights.py: checkpoint_digest). Random
    weights are drawn alike only by engines of one kind of device and dtype."""
    if args.load_format == "dummy":
        config = hashlib.sha256(json.dumps(read_json(os.path.join(model_dir, "config.json")), sort_keys=True).encode())
        return f"dummy-{args.torch_device.type}-{str(args.torch_dtype).removeprefix('torch.')}-{config.hexdigest()[:16]}"
    return checkpoint_digest(model_dir)


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Engine:
    def __init__(self, args: EngineArgs | None = None, model: CausalLM | None = None, **kwargs):
        """`model`: an already built model (benchmarks with random weights); it then has no tokenizer, and
        prompts must be token ids."""
        args = args or EngineArgs(**kwargs)
        self.args = args
        t0 = time.perf_counter()
        self.device = args.torch_device
        self.tp = init_tensor_parallel(args.tp_rank, args.tp_size, args.dist_init_addr, self.device)
        if model is None:
            model_dir = resolve_model_dir(args.model_path)
            if args.quantization is not None:
                why = quantized_already(args.model_path, model_dir)
                if why:
                    raise ValueError(f"--quantization {args.quantization} refused: the checkpoint is quantized "
                                     f"already ({why}); load it as it is")
            self.tokenizer = Tokenizer(args.tokenizer_path or model_dir)
            self.model = load_model(model_dir, args.torch_dtype, self.device, self.tp, dummy=args.load_format == "dummy")
            self.weights_digest = weights_digest(model_dir, args)
        else:
            self.tokenizer = None
            self.model = model
            self.weights_digest = ""
        # Taken from the weights as loaded, so that a worker quantizing them and one that does not agree.
        scales = kv_scales(self.model, args.kv_dtype)
        if args.quantization == "fp8":
            from kernels.fp8_linear import quantize_model

            quantize_model(self.model, lm_head=args.quantize_lm_head)
        self.config: ModelConfig = self.model.config
        self.pool = self._make_pool()
        self.pool.set_scales(*scales)
        if self.pool.is_fp8:
            logger.info("FP8 KV scales from the weights: K %g..%g, V %g..%g", min(scales[0]), max(scales[0]),
                        min(scales[1]), max(scales[1]))
        self.max_model_len = min(args.context_length or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.allocator = PageAllocator(self.pool.num_pages)
        self.cache = None if args.disable_radix_cache else RadixCache(self.allocator, args.page_size)
        self.scheduler = Scheduler(
            SchedulerConfig(args.page_size, args.prefill_budget, args.running_limit), self.allocator, self.cache)
        backend = args.attention_backend or default_backend(self.device)
        attn = create_backend(backend, self.pool, self.config, args.torch_dtype)
        graphs = None
        # A group whose collectives go through the host (TensorParallel.staged) cannot be captured.
        if args.on_cuda and backend == "triton" and not args.disable_cuda_graph and not self.tp.staged:
            from engine.graph import DecodeGraphs

            graphs = DecodeGraphs(self.model, self.pool, attn, min(args.cuda_graph_max_bs, args.running_limit),
                                  min(args.cuda_graph_max_context or self.max_model_len, self.max_model_len),
                                  max_rows=args.running_limit)
            graphs.capture()
        self.runner = ModelRunner(self.model, self.pool, attn, self.device, graphs)
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(eos))
        # Ranks of a tensor-parallel group must draw the same seeds for unseeded requests; a group started by a
        # worker or LLM gets one random_seed for all its ranks (engine/tp_worker.py: group_args).
        self._rng = random.Random(args.random_seed if args.random_seed is not None or args.tp_size == 1 else 0)
        self.requests: dict[str, Request] = {}
        self.awaiting: dict[str, Request] = {}  # pages reserved, KV being written by a prefill worker
        self.held: dict[str, Request] = {}  # finished prefill requests whose pages are still being sent
        self._inflight: _Inflight | None = None  # the launched step whose tokens are not read back yet
        self._steps = 0
        self.load_seconds = time.perf_counter() - t0
        logger.info("engine ready in %.2fs: %s, %s on %s, attention=%s, max_total_num_tokens=%d",
                    self.load_seconds, self.config.model_type, args.torch_dtype, self.device, backend,
                    self.pool.max_total_num_tokens)

    def _make_pool(self) -> KVPool:
        a, c = self.args, self.config
        per_token = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, a.kv_dtype)
        if a.max_total_tokens is not None:
            num_pages = -(-a.max_total_tokens // a.page_size) + 1
        else:
            if a.on_cuda:
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(total * a.mem_fraction) - (total - free)
            else:
                weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
                budget = int(_host_memory_bytes() * a.mem_fraction) - weights
            num_pages = KVPool.pages_for_budget(budget, a.page_size, per_token)
            if num_pages < 2:  # page 0 is reserved: fewer than two pages hold no request at all
                raise ValueError(f"no room for the KV pool: {max(budget, 0):,} bytes are left of --mem-fraction-static "
                                 f"{a.mem_fraction}, and a page of {a.page_size} tokens takes "
                                 f"{a.page_size * per_token:,}; raise --mem-fraction-static, lower --page-size, or "
                                 f"set --max-total-tokens")
        # Every rank must hand out the same pages, so all take the smallest pool any rank has room for.
        num_pages = self.tp.min_int(num_pages)
        try:
            pool = KVPool(num_pages, a.page_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                          a.kv_dtype, self.device, a.kv_layout, self.tp.rank, self.tp.size)
        except (torch.OutOfMemoryError, MemoryError) as e:  # --max-total-tokens asked for more than there is
            raise ValueError(f"a KV pool of {num_pages * a.page_size:,} tokens ({num_pages * a.page_size * per_token:,} "
                             f"bytes) does not fit on {self.device}: lower --max-total-tokens") from e
        logger.info("KV pool: %d pages of %d tokens, max_total_num_tokens=%d, %.1f MiB",
                    num_pages, a.page_size, pool.max_total_num_tokens, pool.data.numel() * pool.data.element_size()
                    / 2**20)
        return pool

    # --- requests ----------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                     rid: str | None = None, detokenize: bool = True, prefill_only: bool = False) -> Request:
        """Validate and build a request; raises ValueError naming the problem."""
        params = SamplingParams.of(params)
        if params.n != 1:  # each sample is a request of its own: SamplingParams.sample(j)
            raise ValueError(f"n must be 1 for one engine request, got {params.n}; LLM.generate and the "
                             f"coordinator run n samples as n requests")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give prompt token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {self.config.vocab_size}), got {bad[:3]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the context length is {self.max_model_len} "
                             f"(at least one token must be left to generate)")
        max_len = self.max_model_len if params.max_tokens is None else min(self.max_model_len,
                                                                             len(ids) + params.max_tokens)
        if prefill_only:  # a prefill worker samples the first token only; decode goes on elsewhere
            max_len = len(ids) + 1
        if max_len > self.pool.max_total_num_tokens:
            raise ValueError(f"request needs up to {max_len} tokens of KV cache but the pool holds "
                             f"{self.pool.max_total_num_tokens}; lower max_tokens")
        for tok in params.stop_token_ids:
            if tok >= self.config.vocab_size:
                raise ValueError(f"stop_token_ids: {tok} is outside the vocabulary (size {self.config.vocab_size})")
        for tok in params.logit_bias or ():
            if tok >= self.config.vocab_size:
                raise ValueError(f"logit_bias: {tok} is outside the vocabulary (size {self.config.vocab_size})")
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        detok = None
        if detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                           params.skip_special_tokens)
        return Request(rid=rid or uuid.uuid4().hex, prompt_ids=ids, params=params, seed=seed,
                       stop_ids=stop_ids, max_len=max_len, detok=detok, hold_pages=prefill_only)

    def add_request(self, prompt, params=None, rid: str | None = None, detokenize: bool = True,
                    prefill_only: bool = False) -> Request:
        req = self.make_request(prompt, params, rid, detokenize, prefill_only)
        self._claim_rid(req.rid)
        self.requests[req.rid] = req
        self.scheduler.add(req)
        return req

    def _claim_rid(self, rid: str) -> None:
        if rid in self.requests or rid in self.awaiting or rid in self.held:
            raise ValueError(f"request id {rid!r} is already in use")

    def abort(self, rid: str) -> bool:
        req = self.requests.pop(rid, None)
        if req is not None:
            self.scheduler.finish(req)
        else:
            req = self.awaiting.pop(rid, None) or self.held.pop(rid, None)
            if req is None:
                return False
            self.scheduler.release(req, cache=False)
        req.finish_reason = "abort"
        req.status = Status.FINISHED
        return True

    # --- KV computed elsewhere (decode role) ---------------------------------------------------------------
    def reserve(self, rid: str, prompt_ids: list[int], params) -> tuple[Request, int] | None:
        """Pages for a request whose prompt KV another worker will write. Returns (request, skip_pages), where
        the first skip_pages pages already hold the prompt's prefix (from this pool's cache), or None when
        the pool has no room now. Raises ValueError for an invalid request."""
        req = self.make_request(list(prompt_ids), params, rid, detokenize=False)
        self._claim_rid(req.rid)
        if not self.scheduler.reserve(req):
            return None
        self.awaiting[req.rid] = req
        return req, req.kv_len // self.args.page_size

    def kv_arrived(self, rid: str, first_token: int, logprob: Logprob | None = None) -> Request | None:
        """The prompt's KV landed in the reserved pages: start decoding after `first_token`."""
        req = self.awaiting.pop(rid, None)
        if req is None:
            return None
        req.kv_len = req.prompt_len
        req.status = Status.RUNNING
        self.requests[rid] = req
        self.scheduler.running.append(req)
        if logprob is not None:
            req.logprobs.append(logprob)
        self._append(req, first_token)
        return req

    def drop_held(self, rid: str) -> None:
        """A prefill worker's request whose KV was sent (or failed to be): free its pages."""
        req = self.held.pop(rid, None)
        if req is not None:
            self.scheduler.release(req)

    def has_work(self) -> bool:
        """Whether step() has anything to compute or read back (requests awaiting KV from elsewhere do not
        count)."""
        return self._inflight is not None or self.scheduler.has_work()

    # --- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that produced a token (finished or not).

        Overlapped (the default): the step is launched on the device, then the previous step's tokens are read
        back and applied while the device computes, so the host work of a step hides behind the device work
        of the next. Returned tokens are therefore one step behind; a request that stops gets one step of
        wasted compute. Steps with repetition/frequency/presence penalties wait for the previous tokens first,
        since the penalties count them.
        """
        prev, self._inflight = self._inflight, None
        if prev is not None and (not self.args.overlap or any(r.params.has_penalties for r in prev.reqs)):
            done, prev = self._resolve(prev), None
        else:
            done = []
        chunks = self.scheduler.schedule()
        if chunks:
            self._inflight = self._launch(chunks, prev)
        if prev is not None:
            done = self._resolve(prev)
        if self._inflight is not None and not self.args.overlap:
            done += self._resolve(self._inflight)
            self._inflight = None
        return done

    def sync(self) -> list[Request]:
        """Wait for the step in flight, if any, and apply its tokens (returned as step() returns them)."""
        prev, self._inflight = self._inflight, None
        return self._resolve(prev) if prev is not None else []

    def _launch(self, chunks, prev: "_Inflight | None") -> "_Inflight | None":
        logits = self.runner.forward(chunks, prev.out.tokens if prev is not None and prev.out is not None else None)
        # Numbered before the pages are cached: a page the cache's copy replaces is still written by this step.
        self._steps += 1
        self.scheduler.fence = self._steps
        sampling = []
        for c in chunks:
            c.req.kv_len = c.start + c.length
            if c.samples:
                sampling.append(c.req)
            if c.length > 1:
                # Share the prompt's full pages as soon as the step that writes them is launched: a request
                # admitted later is stream-ordered behind it (Scheduler._waits_on_prefix counts on this).
                self.scheduler.cache_pages(c.req)
        scores = self.runner.prompt_scores
        prompt = None if scores is None else (scores.owners, [
            _to_host(t) for t in (scores.logprobs, scores.top_logprobs, scores.top_ids)])
        if not sampling:
            event = None
            if scores is not None and scores.logprobs.is_cuda:
                event = torch.cuda.Event()
                event.record()
            return _Inflight(self._steps, [], None, None, event, prompt)
        out = self.runner.sample(logits, sampling)
        for i, req in enumerate(sampling):
            req.pending += 1
            req.pending_row = i
        # A snapshot, read once the step is done: the tokens may be a view of a buffer the next step rewrites
        # (a decode graph's `sampled`), and on a CPU .to("cpu") would not copy.
        host = [_to_host(t) for t in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs)]
        event = None
        if out.tokens.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return _Inflight(self._steps, sampling, out, host, event, prompt)

    def _resolve(self, inf: "_Inflight") -> list[Request]:
        """Wait for a launched step and apply its tokens."""
        if inf.event is not None:
            inf.event.synchronize()
        if inf.prompt is not None:
            self._add_prompt_logprobs(*inf.prompt)
        done = []
        if inf.reqs:
            tokens = inf.host[0].tolist()
            lps = inf.host[1].tolist() if inf.host[1] is not None else None
            tops = (inf.host[2].tolist(), inf.host[3].tolist()) if inf.host[2] is not None else None
            for i, (req, tok) in enumerate(zip(inf.reqs, tokens)):
                req.pending -= 1
                if req.finished:
                    continue  # aborted, or stopped by the token before this one
                if req.params.logprobs is not None:
                    k = req.params.logprobs
                    top = list(zip(tops[0][i][:k], tops[1][i][:k])) if tops and k else []
                    req.logprobs.append(Logprob(tok, lps[i], top))
                self._append(req, tok)
                done.append(req)
        self.scheduler.settle(inf.step)
        return done

    @staticmethod
    def _add_prompt_logprobs(owners, host) -> None:
        lps = host[0].tolist()
        tops = (host[1].tolist(), host[2].tolist()) if host[1] is not None else None
        at = 0
        for req, count in owners:
            k = req.params.prompt_logprobs
            start = len(req.prompt_logprobs) + 1  # the prompt token the next entry scores
            for i in range(count):
                top = list(zip(tops[1][at + i][:k], tops[0][at + i][:k])) if tops and k else []
                req.prompt_logprobs.append(Logprob(req.prompt_ids[start + i], lps[at + i], top))
            at += count

    def _append(self, req: Request, tok: int) -> None:
        if req.num_output == 0 and req.kv_len >= req.prompt_len:
            # The prompt's pages are complete: cache them for requests that share the prefix. (With overlapped
            # steps the next step, already launched, has moved kv_len one past the prompt.)
            self.scheduler.cache_pages(req)
        req.tokens.append(tok)
        # The sampler never draws a stop id before min_tokens, so seeing one here always ends the request.
        if tok in req.stop_ids:
            req.finish_reason, req.stop_reason = "stop", (None if tok in self.eos_ids else tok)
        else:
            if req.detok is not None:
                req.detok.add(tok)
            if req.detok is not None and req.detok.stopped_by is not None:
                req.finish_reason, req.stop_reason = "stop", req.detok.stopped_by
            elif len(req.tokens) >= req.max_len:
                req.finish_reason = "length"
        if req.finish_reason is not None:
            if req.detok is not None:
                req.detok.flush()
            self.requests.pop(req.rid, None)
            if req.hold_pages:
                self.scheduler.finish(req, release=False)
                self.held[req.rid] = req
            else:
                self.scheduler.finish(req)

    def check(self) -> None:
        """Raise if page accounting is off (free + cached + in use != total, or a count is wrong)."""
        self.scheduler.check(extra_owners=list(self.awaiting.values()) + list(self.held.values()))

    def flush_cache(self) -> bool:
        """Drop the prefix cache; only when idle (returns False otherwise)."""
        if self.has_work() or self.cache is None:
            return False
        self.cache.reset()
        return True

    def state_digest(self) -> str:
        """A hash of what the scheduler holds: every request in its queue order with its progress and pages,
        and the pool's accounting. The ranks of a tensor-parallel group must agree on it after every step."""
        h = hashlib.blake2b(digest_size=16)
        for queue in (self.scheduler.running, self.scheduler.waiting, self.awaiting.values(), self.held.values()):
            for r in queue:
                h.update(f"{r.rid}:{r.kv_len}:{len(r.tokens)}:{r.pending}:{r.pages}|".encode())
            h.update(b"/")
        h.update(f"{self.allocator.num_free}:{self.cache.num_pages if self.cache else 0}".encode())
        return h.hexdigest()

    def stats(self) -> dict:
        total = self.allocator.total
        cached = self.cache.num_pages if self.cache else 0
        return {
            "total_pages": total,
            "free_pages": self.allocator.num_free,
            "cached_pages": cached,
            "used_pages": total - self.allocator.num_free,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "awaiting_kv": len(self.awaiting),
            "queued_prefill_tokens": sum(len(r.tokens) - r.kv_len for r in self.scheduler.waiting)
            + sum(len(r.tokens) - r.kv_len for r in self.scheduler.running if len(r.tokens) - r.kv_len > 1),
            "retracted": self.scheduler.num_retracted,
            "prefix_query_tokens": self.cache.query_tokens if self.cache else 0,
            "prefix_hit_tokens": self.cache.hit_tokens if self.cache else 0,
        }
