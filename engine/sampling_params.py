"""Per-request sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

_INT64_MAX = 2**63 - 1
MAX_N = 128  # samples of one prompt in one request (OpenAI's limit)
# Work a request makes for every token of its own, on the process that streams everyone's tokens (stop strings
# are matched on the coordinator's event loop; logit_bias entries are gathered on each step's batch), bounded
# so that one request cannot slow the others: a thousand stop strings of a thousand characters took 9 ms a
# token, 0.1 s before their matching was reworked.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 32, 256
MAX_LOGIT_BIAS = MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob plus the top k
    # None: none; k >= 0: each prompt token's logprob (from the first token on) plus the top k at its position.
    # The prompt is computed in full then (no prefix-cache hit skips its logits).
    prompt_logprobs: int | None = None
    # Token id -> a number in [-100, 100] added to its logit before penalties and sampling (OpenAI's
    # logit_bias; JSON's string keys are taken as ids). Logprobs stay those of the model's own distribution.
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Index of this request's first output token within the generation it continues: a request placed again
    # after its worker died mid-stream starts from its prompt plus what it had generated, and its seeded draws
    # go on where they stopped (the sampler's noise is a function of (seed, output index)).
    output_offset: int = 0
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()} or None
        self.validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(repr, unknown))}")
        return cls(**d)

    @classmethod
    def of(cls, params: "SamplingParams | dict | None") -> "SamplingParams":
        """Params as a caller gives them (None: the defaults; a dict of fields; or SamplingParams), validated."""
        if params is None:
            return cls()
        if isinstance(params, dict):
            return cls.from_dict(params)
        params.validate()
        return params

    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str):
            if not ok:
                got = repr(getattr(self, name))  # echoed to the client: a few hundred characters, not all of it
                raise ValueError(f"{name} {msg}, got {got if len(got) <= 200 else got[:200] + ' ...'}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        need(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        need(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
             "max_tokens", "must be an integer >= 1")
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        need(is_int(self.output_offset) and self.output_offset >= 0, "output_offset", "must be an integer >= 0")
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        need(is_num(self.temperature) and 0 <= self.temperature <= 100, "temperature", "must be in [0, 100]")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be -1, 0 (off) or a positive integer")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.seed is None or (is_int(self.seed) and -_INT64_MAX <= self.seed <= _INT64_MAX),
             "seed", "must be a 64-bit integer")
        need(all(isinstance(s, str) for s in self.stop), "stop", "must be a string or a list of strings")
        need(len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
             f"takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        # JSON's escapes can spell a lone surrogate: no text a model writes holds one, and none can be sent on.
        need(all(s.isascii() or _is_unicode(s) for s in self.stop), "stop", "must be valid Unicode text")
        need(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be a list of token ids")
        need(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"takes at most {MAX_STOP_TOKEN_IDS} ids")
        need(is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
             "repetition_penalty", "must be in (0, 10]")
        need(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty", "must be in [-2, 2]")
        need(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "presence_penalty", "must be in [-2, 2]")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             "logprobs", "must be an integer in [0, 20]")
        need(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "must be an integer in [0, 20]")
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            need(isinstance(getattr(self, flag), bool), flag, "must be a boolean")
        need(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            is_int(k) and k >= 0 and is_num(v) and -100 <= v <= 100 for k, v in self.logit_bias.items())),
             "logit_bias", "must map token ids to numbers in [-100, 100]")
        need(self.logit_bias is None or len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
             f"takes at most {MAX_LOGIT_BIAS} tokens")

    def sample(self, j: int) -> "SamplingParams":
        """The params of the j-th of n samples, each of which runs as a request of its own (n=1). A seeded
        sample j draws with seed + j (seed - j where that would leave the 64-bit range, so the n seeds stay
        distinct): sample 0 is the same request with n=1, and the others differ from it."""
        if not 0 <= j < self.n:
            raise ValueError(f"sample {j} of {self.n}")
        seed = self.seed
        if seed is not None and j:
            seed = seed + j if seed + j <= _INT64_MAX else seed - j
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def changes_logits(self) -> bool:
        """Whether the logits are changed before the draw (penalties, logit_bias): such a request's token is
        never drawn inside a decode graph."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _token_key(k):
    """A logit_bias key: a token id, or its decimal string (JSON objects have string keys); else as given,
    for validate() to name."""
    if isinstance(k, str) and k.strip().lstrip("-").isdigit():
        return int(k)
    return k
