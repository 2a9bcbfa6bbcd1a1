"""Environment variables read by pdserve, all prefixed PDSERVE_, in one place."""

from __future__ import annotations

import os


class Env:
    @staticmethod
    def cache_dir() -> str:
        """Where converted checkpoints are cached (PDSERVE_CACHE_DIR, else ~/.cache/pdserve)."""
        return os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")

    @staticmethod
    def api_keys() -> list[str]:
        """Accepted API keys, comma-separated (PDSERVE_API_KEYS); empty means no authentication."""
        return [k for k in os.environ.get("PDSERVE_API_KEYS", "").split(",") if k]

    @staticmethod
    def tp_backend() -> str | None:
        """torch.distributed backend of a tensor-parallel group (PDSERVE_TP_BACKEND: nccl or gloo; unset: nccl on
        GPUs, gloo on CPUs). gloo lets the ranks share one GPU, which NCCL refuses: a way to run --tp N on a
        one-GPU machine, slowly (collectives through the host, no CUDA graphs), to check its tokens."""
        return os.environ.get("PDSERVE_TP_BACKEND") or None

    @staticmethod
    def select_truncation() -> bool:
        """Top-k and top-p on a GPU by selecting each row's threshold (kernels/truncation.py) rather than by
        sorting the row (PDSERVE_SELECT_TRUNCATION, default 1; 0 sorts). Both keep the same tokens. On an H100
        the selection took 74 us against the sort's 133 for one 150k row, and 688 against 1,459 for 64 rows
        (run Z76, docs/benchmarks.md)."""
        return os.environ.get("PDSERVE_SELECT_TRUNCATION", "1") != "0"

    @staticmethod
    def pdl() -> bool:
        """Launch the decode kernels with programmatic dependent launch on Hopper+ (PDSERVE_PDL, default 1)."""
        return os.environ.get("PDSERVE_PDL", "1") != "0"

    @staticmethod
    def fold_norms() -> bool | None:
        """One-token decode steps on a GPU fold each RMSNorm and residual add into the neighbouring projections'
        GEMV (PDSERVE_FOLD_NORMS=1 always, 0 never). Unset: the model decides by its width (CausalLM.folds).
        On an H200 folding made the 8B step 10 % slower (12 % with FP8 weights) and the 0.5B step 12 % faster
        (run Z54, docs/benchmarks.md)."""
        value = os.environ.get("PDSERVE_FOLD_NORMS")
        return None if value is None or value == "" else value == "1"

    @staticmethod
    def fuse_rope() -> bool:
        """One-token decode steps on a GPU fold rope and the KV store into the qkv projection's GEMV
        (PDSERVE_FUSE_ROPE, default 1; 0 runs rope_store's kernel after the projection). On an H200 it took
        0-5 % off the 8B bf16 step and 2-5 % off the FP8 one, with the same greedy tokens (docs/benchmarks.md)."""
        return os.environ.get("PDSERVE_FUSE_ROPE", "1") != "0"

    @staticmethod
    def norm_squares() -> bool:
        """Where the norms are folded into the projections, o_proj and down_proj also leave the residual
        stream's sum of squares for the next norm, so qkv_proj and gate_up_proj need not gather it
        (PDSERVE_NORM_SQUARES, default 1; 0 gathers it in their K loop)."""
        return os.environ.get("PDSERVE_NORM_SQUARES", "1") != "0"

    @staticmethod
    def norm_squares_summed() -> bool:
        """Where the residual adds leave the sum of squares, the last program of each adds the partial sums
        into one, so the next projection's programs load one number instead of one per program of the add
        (PDSERVE_NORM_SQUARES_SUMMED=1; default 0). Timed on an H100 it cost more than it saved: about a
        microsecond per residual add for the count and the serial sum, and 1.6 % of a folded FP8 8B step (runs
        Z56-Z57, docs/benchmarks.md)."""
        return os.environ.get("PDSERVE_NORM_SQUARES_SUMMED", "0") == "1"

    @staticmethod
    def norm_token() -> bool:
        """Where the residual adds leave the sum of squares (PDSERVE_NORM_SQUARES), they also leave the stream
        times the next norm's weight, in the stream's dtype, and that norm's projection reads it in place of
        the stream, so no GEMV program multiplies by the norm's weight (PDSERVE_NORM_TOKEN, default 1; 0
        multiplies in the K loop)."""
        return os.environ.get("PDSERVE_NORM_TOKEN", "1") != "0"
