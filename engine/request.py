"""A request's state inside a worker."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]  # EOS (unless ignore_eos) plus the request's stop_token_ids
    max_len: int  # prompt + output may not exceed this (context length, max_tokens)
    detok: IncrementalDetokenizer | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    status: Status = Status.WAITING
    # All token ids: the prompt, then the output. KV is computed for tokens[:kv_len].
    tokens: list[int] = field(default_factory=list)
    kv_len: int = 0
    # Tokens sampled on the device but not yet read back (overlapped steps): 0 or 1 when a step is scheduled.
    # The newest one is row `pending_row` of the latest launched step's output.
    pending: int = 0
    pending_row: int = -1
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    logprobs: list[Logprob] = field(default_factory=list)
    # params.prompt_logprobs: entry i scores prompt token i + 1 (the logits at position i). `scored`: positions
    # whose scores a launched step computes or computed (a recomputed prefix is not scored twice).
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    scored: int = 0
    # Server mode: output tokens already sent to the client; hold_pages keeps the KV after finishing
    # (a prefill worker frees it only once the pages reached the decode worker).
    reported: int = 0
    hold_pages: bool = False

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def total_len(self) -> int:
        """Tokens including the ones still on the device."""
        return len(self.tokens) + self.pending

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def text(self) -> str:
        return self.detok.text if self.detok else ""
