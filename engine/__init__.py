"""Shared model code: configs, models, weights, tokenizer, sampling, and the batching worker core."""

from engine.args import EngineArgs
from engine.sampling_params import SamplingParams


def __getattr__(name):
    # LLM and Engine pull in torch models; import them on first use so `import engine` stays light.
    if name in ("LLM", "RequestOutput", "GenerateError"):
        from engine import llm

        return getattr(llm, name)
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["LLM", "Engine", "EngineArgs", "SamplingParams", "RequestOutput", "GenerateError"]
