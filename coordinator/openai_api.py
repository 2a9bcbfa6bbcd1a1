"""OpenAI (and SGLang /generate) request parsing into sampling parameters, with OpenAI-shaped errors.

Every check here raises APIError with the offending parameter's name, so a bad request is a 400 that says
what is wrong -- never FastAPI's 422, never a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.sampling_params import MAX_N, SamplingParams

# Sampling fields taken as they are (vLLM's extensions to the OpenAI API).
_PASS_THROUGH = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                 "skip_special_tokens", "include_stop_str_in_output", "seed", "temperature", "top_p",
                 "presence_penalty", "frequency_penalty", "n")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              413: "invalid_request_error", 503: "service_unavailable_error"}.get(status, "server_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Choices in one request: prompts times n. Each is a request of its own on the workers.
MAX_CHOICES = 1024


@dataclass
class ParsedRequest:
    prompts: list[str | list[int]] | None  # texts to tokenize or token ids (completions, /generate)
    messages: list[dict] | None  # (chat)
    params: dict[str, Any]  # SamplingParams fields, n included
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-k logprobs asked for (0: only the chosen token)
    model: str | None
    echo: bool = False  # completions: the prompt comes back before the completion (with logprobs if asked)
    score_only: bool = False  # echo with max_tokens 0: the prompt alone comes back
    best_of: int | None = None  # n of each prompt's samples (params' n) come back: those of best mean logprob
    # stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far, so a client can
    # tell how many tokens a chunk holds (tokens that queued up while the stream waited leave as one chunk).
    continuous_usage: bool = False
    prompt_param: str = "prompt"  # the body's name of the prompt, for errors about it

    @property
    def n(self) -> int:
        return self.params.get("n", 1)


def _need(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise APIError(400, message, param)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _common(body: dict, params: dict) -> None:
    for name in _PASS_THROUGH:
        if body.get(name) is not None:
            params[name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        _need(isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)),
              "stop", "stop must be a string or a list of strings")
        params["stop"] = [stop] if isinstance(stop, str) else stop
    if body.get("logit_bias") is not None:
        params["logit_bias"] = body["logit_bias"]
    try:
        SamplingParams.from_dict(params)
    except (ValueError, TypeError) as e:
        msg = str(e)
        param = next((f for f in params if msg.startswith(f)), None)
        raise APIError(400, msg, param) from None


def _stream_opts(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = body.get("stream", False)
    _need(isinstance(stream, bool), "stream", "stream must be a boolean")
    opts = body.get("stream_options") or {}
    _need(isinstance(opts, dict), "stream_options", "stream_options must be an object")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        v = opts.get(name)
        _need(v is None or isinstance(v, bool), f"stream_options.{name}", f"stream_options.{name} must be a boolean")
        flags.append(bool(v))
    return stream, flags[0], flags[1]


def _max_tokens(body: dict, *names: str) -> tuple[int | None, bool]:
    for name in names:
        v = body.get(name)
        if v is not None:
            _need(_is_int(v) and v >= 1, name, f"{name} must be an integer >= 1, got {v!r}")
            return v, True
    return None, False


def _prompts(prompt) -> list[str | list[int]]:
    """OpenAI's four shapes of a completions prompt: a string, token ids, or a batch of either."""
    shapes = "prompt must be a string, a list of token ids, or a non-empty list of either"
    if isinstance(prompt, str):
        return [prompt]
    _need(isinstance(prompt, list), "prompt", shapes)
    if all(_is_int(t) for t in prompt):  # ([] too: the server says the prompt is empty)
        return [prompt]
    _need(all(isinstance(x, str) for x in prompt)
          or all(isinstance(x, list) and all(_is_int(t) for t in x) for x in prompt), "prompt", shapes)
    return list(prompt)


def _count_choices(prompts: int, params: dict) -> None:
    n = params.get("n", 1)
    _need(prompts * n <= MAX_CHOICES, "n", f"at most {MAX_CHOICES} choices a request (prompts x n), "
                                           f"got {prompts} x {n}")


def parse_completion(body: dict) -> ParsedRequest:
    _need(isinstance(body, dict), "body", "the request body must be a JSON object")
    prompts = _prompts(body.get("prompt"))
    for unsupported in ("suffix",):
        _need(body.get(unsupported) is None, unsupported, f"{unsupported} is not supported")
    echo = body.get("echo", False)
    _need(isinstance(echo, bool), "echo", "echo must be a boolean")
    n, best_of = body.get("n", 1), body.get("best_of")
    if best_of is not None:
        _need(_is_int(best_of) and best_of <= MAX_N and (not _is_int(n) or n <= best_of), "best_of",
              f"best_of must be an integer in [n, {MAX_N}]")
        _need(best_of == n or not body.get("stream"), "best_of", "best_of greater than n cannot be streamed")
    logprobs = body.get("logprobs")
    _need(logprobs is None or (_is_int(logprobs) and 0 <= logprobs <= 20), "logprobs",
          "logprobs must be an integer in [0, 20]")
    # max_tokens 0 with echo scores the prompt alone: the workers still make one token, which is not shown.
    score_only = echo and body.get("max_tokens") == 0 and _is_int(body["max_tokens"])
    max_tokens, given = (1, True) if score_only else _max_tokens(body, "max_tokens")
    params: dict[str, Any] = {"max_tokens": max_tokens if given else 16}
    if logprobs is not None:
        params["logprobs"] = logprobs
        if echo:
            params["prompt_logprobs"] = logprobs
    _common(body, params)
    best = None
    if best_of is not None and _is_int(n) and best_of > n:
        best, params["n"] = n, best_of
        params.setdefault("logprobs", 0)  # the ranking's; shown only if asked for
    _count_choices(len(prompts), params)
    stream, usage, continuous = _stream_opts(body)
    return ParsedRequest(prompts, None, params, True, stream, usage, logprobs, body.get("model"), echo, score_only,
                         best, continuous)


def parse_chat(body: dict) -> ParsedRequest:
    _need(isinstance(body, dict), "body", "the request body must be a JSON object")
    messages = body.get("messages")
    _need(isinstance(messages, list) and len(messages) > 0, "messages", "messages must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        _need(isinstance(m, dict) and isinstance(m.get("role"), str), f"messages[{i}]",
              "each message needs a string role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            _need(all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                      for p in content), f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        _need(isinstance(content, str), f"messages[{i}].content", "content must be a string")
        clean.append({"role": m["role"], "content": content})
    _need(not body.get("tools"), "tools", "tools are not supported")
    rf = body.get("response_format")
    _need(rf is None or (isinstance(rf, dict) and rf.get("type") == "text"), "response_format",
          "only the text response format is supported")
    want = body.get("logprobs", False)
    _need(isinstance(want, bool), "logprobs", "logprobs must be a boolean")
    top = body.get("top_logprobs")
    _need(top is None or (_is_int(top) and 0 <= top <= 20), "top_logprobs", "top_logprobs must be in [0, 20]")
    _need(top is None or want, "top_logprobs", "top_logprobs needs logprobs: true")
    max_tokens, given = _max_tokens(body, "max_completion_tokens", "max_tokens")
    params: dict[str, Any] = {"max_tokens": max_tokens}
    if want:
        params["logprobs"] = top or 0
    _common(body, params)
    _count_choices(1, params)
    stream, usage, continuous = _stream_opts(body)
    return ParsedRequest(None, clean, params, given, stream, usage, (top or 0) if want else None,
                         body.get("model"), continuous_usage=continuous, prompt_param="messages")


# SGLang /generate: sampling_params use SGLang's names.
_SGLANG_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def parse_generate(body: dict) -> ParsedRequest:
    _need(isinstance(body, dict), "body", "the request body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    _need((text is None) != (ids is None), "text", "give exactly one of text and input_ids")
    if ids is not None:
        _need(isinstance(ids, list) and all(_is_int(t) for t in ids), "input_ids", "input_ids must be token ids")
    else:
        _need(isinstance(text, str), "text", "text must be a string")
    sp = body.get("sampling_params") or {}
    _need(isinstance(sp, dict), "sampling_params", "sampling_params must be an object")
    params = {_SGLANG_RENAMES.get(k, k): v for k, v in sp.items()}
    params.setdefault("max_tokens", 128)
    try:
        SamplingParams.from_dict(params)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), "sampling_params") from None
    _need(params.get("n", 1) == 1, "sampling_params", "n must be 1 here; /v1/completions serves n samples")
    stream = body.get("stream", False)
    _need(isinstance(stream, bool), "stream", "stream must be a boolean")
    return ParsedRequest([text if ids is None else ids], None, params, True, stream, False, None, None,
                         prompt_param="text" if ids is None else "input_ids")
