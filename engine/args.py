"""Engine configuration: one frozen dataclass, flag names as in SGLang where the meaning is the same."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

import torch


KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class EngineArgs:
    # Model directory (HF layout), a .gguf file, or None for the embedded SmolLM2-135M-Instruct.
    model_path: str | None = None
    # Tokenizer directory when it differs from the model's.
    tokenizer_path: str | None = None
    # "auto": float32 on CPU, bfloat16 on CUDA; or float32 / float16 / bfloat16.
    dtype: str = "auto"
    # "auto": cuda when available, else cpu.
    device: str = "auto"
    # Tokens per KV page.
    page_size: int = 16
    # Fraction of device memory (host memory on CPU) for weights plus the KV pool. Default: 0.85 on CUDA,
    # 0.1 on CPU (a CPU box runs other processes, and small pools suffice there).
    mem_fraction_static: float | None = None
    # Size the KV pool by tokens instead (takes precedence over mem_fraction_static).
    max_total_tokens: int | None = None
    # Context length; default: the model's max_position_embeddings.
    context_length: int | None = None
    # Token budget of one step (prefill chunks plus decode tokens). Default: 8192 on CUDA, 1024 on CPU.
    chunked_prefill_size: int | None = None
    # Requests in the running batch at most. Default: 256 on CUDA, 64 on CPU.
    max_running_requests: int | None = None
    # torch (reference, any device) or triton (GPU; CPU only under TRITON_INTERPRET). Default: fastest available.
    attention_backend: str | None = None
    # "auto" (the model dtype), "fp8_e4m3" / "fp8_e5m2" (one byte per value, with per-layer scales: twice the
    # tokens of bf16 in the same memory), or bfloat16 / float16 / float32.
    kv_cache_dtype: str = "auto"
    # Layout of a KV page: "NHD" (each token's heads side by side) or "HND" (each head's tokens side by side,
    # FlashInfer's other layout). NHD is the default: on an H200 both the triton and the flashinfer decode
    # kernels read it faster (docs/benchmarks.md). Prefill and decode workers must agree; the coordinator
    # only pairs workers that do.
    kv_layout: str = "NHD"
    # "fp8": quantize the decoder's weights to FP8 on load (per output channel; activations per token).
    # Refused for checkpoints that are quantized already.
    quantization: str | None = None
    # With quantization "fp8", the LM head too (a tied one gets an FP8 copy of the embedding table). Off by
    # default, as in the serving engines it is measured against: the head's rounding moves every logit.
    quantize_lm_head: bool = False
    # Turn off prefix caching (pages are freed as soon as their request ends).
    disable_radix_cache: bool = False
    # Seed for requests that bring none.
    random_seed: int | None = None
    # Tensor parallelism: this process is rank tp_rank of tp_size, meeting the others at dist_init_addr
    # (a torch.distributed init method such as tcp://10.0.0.1:29500). Every rank runs the same requests.
    # A worker (`pdserve prefill/decode/worker --tp N`) is rank 0 and starts ranks 1..N-1 itself, on this
    # host, at a free local address when dist_init_addr is None (engine/tp_worker.py).
    tp_size: int = 1
    tp_rank: int = 0
    dist_init_addr: str | None = None
    # The first GPU this process group uses: rank r runs on cuda:(base_gpu_id + r) ("device" auto).
    base_gpu_id: int = 0
    # CUDA graphs for decode steps (GPU, triton backend): off switch, largest batch, longest context (None:
    # the model's context length; a step with a longer context runs eagerly, several times slower).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 160
    cuda_graph_max_context: int | None = None
    # Run each step synchronously instead of launching step N+1 before reading back step N's tokens.
    disable_overlap_schedule: bool = False
    # "auto": the checkpoint's weights; "dummy": random weights of the checkpoint's shapes (config.json and
    # the tokenizer are still read), for benchmarks of real shapes without the weight files.
    load_format: str = "auto"

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.attention_backend == "flashinfer" and self.page_size > 32:
            # FlashInfer 0.7.2's decode kernel read out of bounds with 64-token pages on an H200 (bf16, head
            # dim 128, docs/benchmarks.md run Z28), which kills the whole worker; 16 and 32 agreed with triton.
            raise ValueError(f"the flashinfer backend is verified for page_size <= 32, got {self.page_size}; "
                             "use --attention-backend triton for larger pages")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("max_total_tokens", "context_length", "chunked_prefill_size", "max_running_requests",
                     "cuda_graph_max_bs", "cuda_graph_max_context"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got {self.tp_rank} of {self.tp_size}")
        if self.tp_size > 1 and not self.dist_init_addr:
            raise ValueError("tensor parallelism needs dist_init_addr (e.g. tcp://127.0.0.1:29500)")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 (or unset), got {self.quantization!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs a quantization (--quantization fp8)")
        if self.kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be NHD or HND, got {self.kv_layout!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        interpreted = self.attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
        if self.attention_backend in ("triton", "flashinfer") and not self.on_cuda and not interpreted:
            raise ValueError(f"the {self.attention_backend} backend runs on a GPU, and this engine's device is "
                             f"{self.torch_device}: use --attention-backend torch")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            # An integer pool (int8) would store K and V truncated to integers, with nothing to scale them back:
            # it served garbage instead of failing.
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose from {list(KV_CACHE_DTYPES)}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", self.base_gpu_id + self.tp_rank)
            return torch.device("cpu")
        return torch.device(self.device)

    @property
    def on_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.on_cuda else torch.float32
        return getattr(torch, self.dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
        return fp8.get(self.kv_cache_dtype) or getattr(torch, self.kv_cache_dtype)

    @property
    def overlap(self) -> bool:
        return not self.disable_overlap_schedule

    @property
    def mem_fraction(self) -> float:
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        return 0.85 if self.on_cuda else 0.1

    @property
    def prefill_budget(self) -> int:
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return 8192 if self.on_cuda else 1024

    @property
    def running_limit(self) -> int:
        if self.max_running_requests is not None:
            return self.max_running_requests
        return 256 if self.on_cuda else 64

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        p = parser
        p.add_argument("--model-path", default=None, help="HF model directory or .gguf file (default: embedded)")
        p.add_argument("--tokenizer-path", default=None)
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
        p.add_argument("--device", default="auto")
        p.add_argument("--page-size", type=int, default=16)
        p.add_argument("--mem-fraction-static", type=float, default=None)
        p.add_argument("--max-total-tokens", type=int, default=None)
        p.add_argument("--context-length", type=int, default=None)
        p.add_argument("--chunked-prefill-size", type=int, default=None)
        p.add_argument("--max-running-requests", type=int, default=None)
        p.add_argument("--attention-backend", default=None)
        p.add_argument("--kv-cache-dtype", default="auto")
        p.add_argument("--kv-layout", default="NHD", choices=["NHD", "HND"])
        p.add_argument("--disable-radix-cache", action="store_true")
        p.add_argument("--quantization", default=None, choices=["fp8"])
        p.add_argument("--quantize-lm-head", action="store_true")
        p.add_argument("--random-seed", type=int, default=None)
        p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
        p.add_argument("--tp-rank", type=int, default=0)
        p.add_argument("--dist-init-addr", default=None)
        p.add_argument("--base-gpu-id", type=int, default=0)
        p.add_argument("--disable-cuda-graph", action="store_true")
        p.add_argument("--cuda-graph-max-bs", type=int, default=160)
        p.add_argument("--cuda-graph-max-context", type=int, default=None)
        p.add_argument("--disable-overlap-schedule", action="store_true")
        p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
