"""Offline batch API shaped like vLLM's: LLM(model_path).generate(prompts, params)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.args import EngineArgs
from engine.engine import Engine
from engine.request import Logprob, Request
from engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(lp.logprob for lp in self.logprobs) if self.logprobs else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    # With params.prompt_logprobs: None for the first prompt token (nothing scores it), then each token's.
    prompt_logprobs: list[Logprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @classmethod
    def from_requests(cls, reqs: list[Request], prompt: str | None) -> "RequestOutput":
        """One prompt's n samples (requests of their own, in sample order)."""
        outs = [CompletionOutput(j, r.text, list(r.output_ids), r.finish_reason, r.stop_reason,
                                 list(r.logprobs) if r.params.logprobs is not None else None)
                for j, r in enumerate(reqs)]
        first = reqs[0]
        scored = [None] + list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None
        return cls(first.rid, prompt, list(first.prompt_ids), outs, max(r.cached_tokens for r in reqs), True, scored)


class GenerateError(ValueError):
    """Some prompts were invalid. `errors` maps their indices to messages; `outputs` holds the results of
    the valid ones (None at the invalid indices), which were run to completion."""

    def __init__(self, errors: dict[int, str], outputs: list[RequestOutput | None]):
        self.errors = errors
        self.outputs = outputs
        detail = "; ".join(f"prompt {i}: {m}" for i, m in sorted(errors.items()))
        super().__init__(f"{len(errors)} invalid request(s): {detail}")


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """`kwargs`: EngineArgs fields. With tp_size N > 1 the engine is rank 0 of N and starts the other ranks
        as child processes on this host (engine/tp_worker.py); `close()` (or leaving a `with` block) stops
        them, as does this process's exit."""
        self.followers = None
        if kwargs.get("tp_size", 1) > 1:
            from engine.tp_worker import Followers, MirroredEngine, group_args, local_dist_addr

            kwargs.setdefault("dist_init_addr", local_dist_addr())  # (EngineArgs wants one with tp_size > 1)
            args = group_args(EngineArgs(model_path=model, **kwargs))
            if args.tp_rank != 0:
                raise ValueError("LLM is rank 0 of its tensor-parallel group and starts the other ranks itself")
            self.followers = Followers(args, "llm")
            try:
                self.engine = MirroredEngine(Engine(args), self.followers)
                self.followers.wait_ready()
            except BaseException:
                self.close()
                raise
        else:
            self.engine = Engine(EngineArgs(model_path=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        if self.followers is not None:
            from engine.parallel import leave_group

            self.followers.close()
            self.followers = None
            leave_group()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """Run every prompt to completion. A prompt is a string or {"prompt_token_ids": [...]}; the params
        one SamplingParams (or dict) for all, or one per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params] * len(prompts)
        reqs: list[list[Request] | None] = []
        errors: dict[int, str] = {}
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                reqs.append(self._add(self._prompt_input(prompt), params))
            except (ValueError, TypeError) as e:
                errors[i] = str(e)
                reqs.append(None)
        while self.engine.has_work():
            self.engine.step()
        outputs = [None if r is None else RequestOutput.from_requests(r, p if isinstance(p, str) else None)
                   for r, p in zip(reqs, prompts)]
        if errors:
            raise GenerateError(errors, outputs)
        return outputs

    def chat(self, messages, sampling_params=None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(m)} for m in convs]
        return self.generate(prompts, sampling_params)

    def _add(self, prompt, params) -> list[Request]:
        """The prompt's n samples as n requests."""
        params = SamplingParams.of(params)
        if params.n == 1:
            return [self.engine.add_request(prompt, params)]
        if isinstance(prompt, str) and self.engine.tokenizer is not None:
            prompt = self.engine.tokenizer.encode(prompt)  # once, not once per sample
        # The samples differ only in their seeds: if the first is valid, all are.
        return [self.engine.add_request(prompt, params.sample(j)) for j in range(params.n)]

    @staticmethod
    def _prompt_input(prompt):
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, dict):
            extra = set(prompt) - {"prompt_token_ids", "prompt"}
            if extra:
                raise ValueError(f"unknown prompt field(s): {sorted(extra)}")
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"]
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {prompt!r:.80}")
