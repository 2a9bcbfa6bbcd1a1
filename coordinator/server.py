"""The coordinator's HTTP front door: OpenAI-compatible completions and chat, SGLang-style /generate,
health, models and metrics. Errors always come in OpenAI's shape with the right status."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.dispatcher import Dispatcher, PlacementError
from coordinator.generation import Generation, WorkerFailed, collect_all, interleave
from coordinator.metrics import Metrics
from coordinator.openai_api import APIError, ParsedRequest, parse_chat, parse_completion, parse_generate
from coordinator.registry import make_registry
from engine.env import Env
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_json_encode = msgspec.json.Encoder().encode

# The other samples of a prompt wait for the first one's first token when the worker computing the prompt
# lacks at least this many of its tokens: the wait costs them that first token's latency, and pays where there
# is much of the prompt to compute and send, not where its worker has it cached or the prompt is short.
SHARED_PROMPT_WAIT = 64


@dataclass(frozen=True)
class CoordinatorArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    # ZMQ address workers reply to; port None picks a free one.
    zmq_host: str = "127.0.0.1"
    zmq_port: int | None = None
    model_path: str | None = None
    served_model_name: str | None = None
    redis_url: str | None = None
    api_keys: tuple[str, ...] = field(default_factory=tuple)
    transfer_backend: str = "auto"
    # How long a request may wait for a worker with room before it gets 503.
    admission_timeout_s: float = 30.0
    context_length: int | None = None
    # Largest request body taken, in bytes (413 beyond it): parsing JSON holds the event loop, every stream's,
    # for about 10 ms a megabyte. The default leaves room for 128 prompts of 128k tokens given as ids.
    max_request_bytes: int = 64 << 20
    # Workers end this coordinator's requests once they have not heard from it for this long (it renews every
    # second): a coordinator that died leaves nothing decoding for nobody.
    lease_timeout_s: float = 15.0
    # On SIGTERM the coordinator stops taking connections and lets the requests it has finish for this long;
    # those still running then end with an error their clients see (503), and their workers free them.
    graceful_shutdown_timeout_s: float = 10.0

    def __post_init__(self):
        for name in ("port", "zmq_port"):
            v = getattr(self, name)
            if v is not None and not 1 <= v <= 65535:
                raise ValueError(f"{name} must be in [1, 65535], got {v}")
        if self.admission_timeout_s <= 0:
            raise ValueError(f"admission_timeout_s must be > 0, got {self.admission_timeout_s}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not self.graceful_shutdown_timeout_s >= 0:
            raise ValueError(f"graceful_shutdown_timeout_s must be >= 0, got {self.graceful_shutdown_timeout_s}")
        if not self.lease_timeout_s >= 2.0:
            raise ValueError(f"lease_timeout_s must be >= 2 (the lease is renewed every second), got "
                             f"{self.lease_timeout_s}")


class Coordinator:
    def __init__(self, args: CoordinatorArgs):
        from engine.config import ModelConfig
        from engine.loader import EMBEDDED_FILE, resolve_model_dir
        from engine.tokenizer import Tokenizer

        self.args = args
        model_dir = resolve_model_dir(args.model_path)
        self.tokenizer = Tokenizer(model_dir)
        self.context_length = args.context_length or ModelConfig.from_dir(model_dir).max_position_embeddings
        default_name = EMBEDDED_FILE.split(".")[0] if args.model_path is None else \
            args.model_path.rstrip("/").split("/")[-1].removesuffix(".gguf")
        self.model_name = args.served_model_name or default_name
        self.api_keys = tuple(args.api_keys) or tuple(Env.api_keys())
        self.registry = make_registry(args.redis_url)
        self.dispatcher = Dispatcher(self.registry, args.zmq_host, args.zmq_port, args.transfer_backend,
                                     args.admission_timeout_s, vocab=self.tokenizer.vocab_digest(),
                                     lease_ttl_s=args.lease_timeout_s)
        self.metrics = Metrics(lambda: list(self.dispatcher.workers.values()), lambda: self.dispatcher.placed_again)


def create_app(args: CoordinatorArgs) -> FastAPI:
    co = Coordinator(args)

    @asynccontextmanager
    async def lifespan(app):
        await co.dispatcher.start()
        # What the first request would pay for otherwise (0.2-0.4 s of its TTFT on a 2-core machine): the
        # thread that templates and tokenizes prompts, the tokenizer's bound on a prompt's length (it reads the
        # whole vocabulary once), and anyio's event-loop backend, which starlette imports at a request's first
        # check for a departed client.
        await asyncio.to_thread(co.tokenizer.max_chars, 1)
        await anyio.sleep(0)
        logger.info("coordinator: http://%s:%d, workers report to %s (event loop: %s)", args.host, args.port,
                    co.dispatcher.addr, type(asyncio.get_running_loop()).__module__.split(".")[0])
        yield
        await co.dispatcher.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.coordinator = co

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        return error(APIError(400, f"invalid request: {e.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        logger.exception("unhandled error")
        return error(APIError(500, "internal error"))

    def check_auth(request: Request) -> None:
        if not co.api_keys:
            return
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(key, k) for k in co.api_keys):
            raise APIError(401, "missing or invalid API key", type_="authentication_error",
                           code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        cap = co.args.max_request_bytes
        too_large = APIError(413, f"the request body is larger than this server takes ({cap:,} bytes)",
                             code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise too_large  # refused unread
        chunks, size = [], 0
        async for chunk in request.stream():  # a body without a length is counted as it comes
            size += len(chunk)
            if size > cap:
                raise too_large
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def check_model(p: ParsedRequest) -> None:
        if p.model is not None and p.model != co.model_name:
            raise APIError(404, f"the model {p.model!r} does not exist; this server serves {co.model_name!r}",
                           "model", code="model_not_found")

    def fits(text: str, param: str) -> str:
        """A text longer than any that encodes within the context is refused untokenized: a prompt of megabytes
        would otherwise hold a thread for seconds, only to be refused then."""
        most = co.tokenizer.max_chars(co.context_length)
        if most is not None and len(text) > most:
            raise APIError(400, f"This model's maximum context length is {co.context_length} tokens; a prompt of "
                                f"{len(text)} characters is longer than any of that many tokens of this "
                                f"tokenizer. Please reduce the prompt.", param, code="context_length_exceeded")
        return text

    def tokens(text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return co.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as e:  # text that is not Unicode
            raise APIError(400, f"{param}: {e}", param) from None

    def encode(p: ParsedRequest, prompt) -> list[int]:
        if p.messages is not None:
            try:
                text = co.tokenizer.apply_chat_template(p.messages)
            except Exception as e:  # a template that raises on these messages
                raise APIError(400, f"chat template: {e}", "messages") from None
            ids = tokens(fits(text, "messages"), "messages", add_special_tokens=False)
        elif isinstance(prompt, list):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < co.tokenizer.vocab_size]
            if bad:
                raise APIError(400, f"token ids out of the vocabulary: {bad[:3]}", p.prompt_param)
        else:
            ids = tokens(fits(prompt, p.prompt_param), p.prompt_param)
        if not ids:
            raise APIError(400, "the prompt is empty", p.prompt_param)
        return ids

    def choices(p: ParsedRequest) -> list[tuple[list[int], dict, str | None]]:
        """(prompt ids, sampling params, prompt text) of each choice: prompt by prompt, n samples each (choice
        index prompt * n + sample, as OpenAI numbers them)."""
        ctx = co.context_length
        out = []
        for prompt in p.prompts if p.messages is None else [None]:
            ids = encode(p, prompt)
            params = dict(p.params)
            if not p.max_tokens_given or params.get("max_tokens") is None:
                params["max_tokens"] = max(1, ctx - len(ids))
            want = len(ids) + params["max_tokens"]
            if len(ids) >= ctx or want > ctx:
                raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                    f"{want} tokens ({len(ids)} in the prompt, {params['max_tokens']} for the "
                                    f"completion). Please reduce the prompt or max_tokens.", "max_tokens",
                               code="context_length_exceeded")
            sp = SamplingParams.from_dict(params)
            for j in range(sp.n):
                seed = sp.sample(j).seed
                sample = {**params, "n": 1} | ({} if seed is None else {"seed": seed})
                if j:
                    sample.pop("prompt_logprobs", None)  # the first sample scores the prompt for all
                out.append((ids, sample, prompt if isinstance(prompt, str) else None))
        return out

    async def start_one(ids: list[int], params: dict, text: str | None = None, near=None) -> Generation:
        gen = Generation(co.dispatcher, co.tokenizer, ids, params, co.metrics)
        gen.prompt_text = text
        try:
            await gen.start_on_workers(near)
        except asyncio.CancelledError:  # the client left while the request waited for workers
            co.metrics.requests.labels("abort").inc()
            raise
        except PlacementError as e:
            co.metrics.requests.labels("rejected").inc()
            if e.status == 503:
                raise APIError(503, str(e), headers={"Retry-After": "1"}) from None
            raise APIError(e.status, str(e)) from None
        return gen

    async def start(p: ParsedRequest) -> list[Generation]:
        """Every choice placed on workers, or none: if one cannot be (or the client leaves meanwhile), those
        that were are freed. The samples of one prompt go to the workers of its first, once its first token is
        out (SHARED_PROMPT_WAIT): the prompt is computed and sent once, and shared on the decode worker."""
        # Templates and tokenization run beside the event loop (the tokenizer lets go of the GIL), so that a
        # long prompt does not stall every stream this process serves.
        jobs = await asyncio.to_thread(choices, p)
        if len(jobs) == 1:
            return [await start_one(*jobs[0])]
        placed: list[Generation] = []

        async def one(job, near=None) -> Generation:
            gen = await start_one(*job, near=near)
            placed.append(gen)
            return gen

        def first_failure(results: list) -> None:
            for r in results:
                if isinstance(r, BaseException):
                    raise r

        # Every placement runs to its end (none is cut off halfway through a reservation) before a failure
        # frees what was placed.
        async def place(samples: list) -> list[Generation]:
            first = await one(samples[0])
            if len(samples) > 1 and (len(first.prompt_ids) - first.tracked.prompt_seen >= SHARED_PROMPT_WAIT
                                     or first.params.get("prompt_logprobs") is not None):
                await first.tracked.prompt_ready.wait()
            rest = await asyncio.gather(*(one(job, first.tracked) for job in samples[1:]), return_exceptions=True)
            first_failure(rest)
            for gen in rest:
                gen.scores_from = first
            return [first, *rest]

        try:
            groups = await asyncio.gather(*(place(jobs[i:i + p.n]) for i in range(0, len(jobs), p.n)),
                                          return_exceptions=True)
            first_failure(groups)
        except BaseException:
            for gen in placed:
                gen.cancel()
            raise
        return [gen for group in groups for gen in group]

    async def until_disconnect(request: Request, task: asyncio.Task):
        """Await a task of this request's (its placement, or a non-streaming generation), cancelling it if
        the client goes away: under load, a client that gave up must not still cost a prefill."""
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()
                    break
        except asyncio.CancelledError:  # this handler itself: the task must not outlive it
            task.cancel()
            raise
        return await task

    async def start_while_connected(request: Request, p: ParsedRequest) -> list[Generation] | None:
        """start(p), or None if the client left before its request was placed (what was placed is freed)."""
        try:
            return await until_disconnect(request, asyncio.create_task(start(p)))
        except asyncio.CancelledError:
            return None

    def usage(gens: list[Generation], n: int = 1, shown: bool = True) -> dict:
        # A prompt's tokens count once however many samples (n) it has: its samples are consecutive choices.
        prompts = gens[::n]
        n_prompt = sum(len(g.prompt_ids) for g in prompts)
        n_out = sum(len(g.output_ids) for g in gens) if shown else 0
        cached = sum(max(g.cached_tokens for g in gens[i:i + n]) for i in range(0, len(gens), n))
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def sse(obj) -> bytes:
        # msgspec writes UTF-8 as it is (as ensure_ascii=False did) in a fraction of json.dumps's time, which
        # was a tenth of the coordinator's time a streamed token; a non-finite float becomes null, not NaN.
        return b"data: " + _json_encode(obj) + b"\n\n"

    async def run(request: Request, p: ParsedRequest, render_full, render_chunk, render_first=None):
        gens = await start_while_connected(request, p)
        if gens is None:
            return Response(status_code=499)
        rid = f"{'chatcmpl' if p.messages is not None else 'cmpl'}-{gens[0].rid}"
        created = int(time.time())
        # Which workers stream this request: for operators, and for tests that kill workers.
        headers = {"X-PDServe-Worker": ",".join(dict.fromkeys(g.tracked.decode_id or "" for g in gens))}
        if not p.stream:
            try:
                pieces = await until_disconnect(request, asyncio.create_task(collect_all(gens)))
            except WorkerFailed as e:
                raise APIError(503, f"the request failed: {e}", headers={"Retry-After": "1"}) from None
            except asyncio.CancelledError:
                return Response(status_code=499)
            return JSONResponse(render_full(rid, created, gens, pieces), headers=headers)

        async def events():
            try:
                if render_first is not None:
                    for i in range(len(gens)):
                        yield sse(render_first(rid, created, i))
                sent = [0] * len(gens)  # tokens streamed so far, each choice
                async for i, piece in interleave(gens):
                    chunk = render_chunk(rid, created, i, piece, gens[i])
                    if p.continuous_usage:
                        sent[i] += len(piece.token_ids)
                        so_far = usage(gens, p.n, not p.score_only)
                        so_far["completion_tokens"] = sum(sent) if not p.score_only else 0
                        so_far["total_tokens"] = so_far["prompt_tokens"] + so_far["completion_tokens"]
                        chunk["usage"] = so_far
                    yield sse(chunk)
                if p.include_usage:
                    yield sse({"id": rid, "object": chunk_object, "created": created, "model": co.model_name,
                               "choices": [], "usage": usage(gens, p.n, not p.score_only)})
            except WorkerFailed as e:
                yield sse(APIError(503, f"the request failed: {e}").body())
            yield "data: [DONE]\n\n"

        chunk_object = "chat.completion.chunk" if p.messages is not None else "text_completion"
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    # --- completions ----------------------------------------------------------------------------------------
    def completion_logprobs(lps, offset: int = 0) -> dict:
        """OpenAI's legacy logprobs; text_offset: where each token's text starts in the choice's text, the
        first at `offset` (a stream's chunks go on from the text sent before)."""
        starts = []
        for _, text, _, _ in lps:
            starts.append(offset)
            offset += len(text)
        return {"tokens": [t for _, t, _, _ in lps], "token_logprobs": [lp for _, _, lp, _ in lps],
                "top_logprobs": [None if top is None else
                                 {co.tokenizer.decode([i], skip_special_tokens=False): v for i, v in top}
                                 for _, _, _, top in lps], "text_offset": starts}

    def echoed(gen: Generation) -> tuple[str, list]:
        """The prompt as echo gives it back: its text, and its tokens as logprob entries (the first scored by
        nothing: None)."""
        text = gen.prompt_text if gen.prompt_text is not None else \
            co.tokenizer.decode(gen.prompt_ids, skip_special_tokens=False)
        scores = [(None, None)] + [(lp, top) for lp, top in gen.prompt_logprobs or []]
        return text, [(t, co.tokenizer.decode([t], skip_special_tokens=False), lp, top)
                      for t, (lp, top) in zip(gen.prompt_ids, scores)]

    def best(samples: list[tuple[Generation, list]], keep: int) -> list[tuple[Generation, list]]:
        """best_of: the `keep` samples of one prompt with the highest mean logprob per token, best first."""
        def mean_logprob(sample) -> float:
            lps = [lp for piece in sample[1] for _, _, lp, _ in piece.logprobs]
            return sum(lps) / len(lps) if lps else float("-inf")

        return sorted(samples, key=mean_logprob, reverse=True)[:keep]

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        p = parse_completion(await read_json(request))
        check_model(p)

        def full(rid, created, gens, pieces):
            def choice(i, gen, pieces):
                lps = [x for piece in pieces for x in piece.logprobs]
                text = "".join(x.text for x in pieces)
                if p.score_only:
                    text, lps = echoed(gen)
                elif p.echo:
                    prompt, prompt_lps = echoed(gen)
                    text, lps = prompt + text, prompt_lps + lps
                return {"index": i, "text": text,
                        "logprobs": completion_logprobs(lps) if p.logprobs is not None else None,
                        "finish_reason": "length" if p.score_only else gen.finish_reason,
                        "stop_reason": None if p.score_only else pieces[-1].stop_reason}

            kept = list(zip(gens, pieces))
            if p.best_of is not None:
                kept = [x for i in range(0, len(kept), p.n) for x in best(kept[i:i + p.n], p.best_of)]
            return {"id": rid, "object": "text_completion", "created": created, "model": co.model_name,
                    "choices": [choice(i, g, ps) for i, (g, ps) in enumerate(kept)],
                    "usage": usage(gens, p.n, not p.score_only)}

        sent: dict[int, int] = {}  # a streamed choice's text so far, in characters

        def chunk(rid, created, i, piece, gen):
            text, lps, finish = piece.text, piece.logprobs, piece.finish_reason
            if p.score_only:
                text, lps = echoed(gen) if piece.first else ("", [])
                finish = finish and "length"
            elif p.echo and piece.first:
                prompt, prompt_lps = echoed(gen)
                text, lps = prompt + text, prompt_lps + lps
            offset = sent.get(i, 0)
            sent[i] = offset + len(text)
            return {"id": rid, "object": "text_completion", "created": created, "model": co.model_name,
                    "choices": [{"index": i, "text": text,
                                 "logprobs": completion_logprobs(lps, offset) if p.logprobs is not None else None,
                                 "finish_reason": finish}]}

        return await run(request, p, full, chunk)

    # --- chat -----------------------------------------------------------------------------------------------
    def chat_logprobs(lps) -> dict:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": co.tokenizer.decode([i], skip_special_tokens=False),
                                               "logprob": v} for i, v in top]} for _, t, lp, top in lps]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_auth(request)
        p = parse_chat(await read_json(request))
        check_model(p)

        def full(rid, created, gens, pieces):
            def choice(i, gen, pieces):
                lps = [x for piece in pieces for x in piece.logprobs]
                return {"index": i, "message": {"role": "assistant", "content": "".join(x.text for x in pieces)},
                        "logprobs": chat_logprobs(lps) if p.logprobs is not None else None,
                        "finish_reason": gen.finish_reason}

            return {"id": rid, "object": "chat.completion", "created": created, "model": co.model_name,
                    "choices": [choice(i, g, ps) for i, (g, ps) in enumerate(zip(gens, pieces))],
                    "usage": usage(gens, p.n, not p.score_only)}

        def first(rid, created, i):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": co.model_name,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}

        def chunk(rid, created, i, piece, gen):
            delta = {"content": piece.text} if piece.text else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": co.model_name,
                    "choices": [{"index": i, "delta": delta,
                                 "logprobs": chat_logprobs(piece.logprobs) if p.logprobs is not None else None,
                                 "finish_reason": piece.finish_reason}]}

        return await run(request, p, full, chunk, first)

    # --- SGLang-style generate -------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        check_auth(request)
        p = parse_generate(await read_json(request))
        gens = await start_while_connected(request, p)
        if gens is None:
            return Response(status_code=499)
        gen, = gens

        def meta(finish):
            return {"id": gen.rid, "prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(gen.output_ids),
                    "cached_tokens": gen.cached_tokens,
                    "finish_reason": {"type": finish.finish_reason, "matched": finish.stop_reason}
                    if finish and finish.finish_reason else None}

        if not p.stream:
            try:
                pieces, = await until_disconnect(request, asyncio.create_task(collect_all([gen])))
            except WorkerFailed as e:
                raise APIError(503, f"the request failed: {e}") from None
            except asyncio.CancelledError:
                return Response(status_code=499)
            return JSONResponse({"text": gen.text, "output_ids": gen.output_ids, "meta_info": meta(pieces[-1])})

        async def events():
            try:
                async for piece in gen.pieces():
                    yield sse({"text": gen.text, "output_ids": list(gen.output_ids), "meta_info": meta(piece)})
            except WorkerFailed as e:
                yield sse(APIError(503, str(e)).body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # --- the rest --------------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": co.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": co.context_length}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from coordinator.cli import package_version

        return {"version": package_version()}

    @app.get("/health/ready")
    async def ready():
        workers = co.dispatcher.serving()
        roles = {r: sum(1 for w in workers if w.role == r) for r in ("prefill", "decode", "colocated")}
        body = {"workers": roles, "draining": len(co.dispatcher.workers) - len(workers)}
        if not co.dispatcher.ready():
            return JSONResponse({"status": "not ready", **body}, status_code=503)
        return {"status": "ready", **body}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(co.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/workers")
    async def workers(request: Request):
        """The registry's view: role, address, load of every live worker (for pdctl and operators)."""
        check_auth(request)
        import msgspec

        return [msgspec.to_builtins(w) for w in co.dispatcher.workers.values()]

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) stops taking connections and waits for the open ones;
    past `grace_s` the requests still running end with an error their clients read, rather than being cut off
    mid-stream (uvicorn would cancel them) or waited for without end. A second signal ends the grace."""

    def __init__(self, config: uvicorn.Config, dispatcher: Dispatcher, grace_s: float):
        super().__init__(config)
        self.dispatcher = dispatcher
        self.grace_s = grace_s
        self.hurry = False  # a second signal: the grace is over

    def handle_exit(self, sig, frame) -> None:
        again = self.should_exit
        super().handle_exit(sig, frame)
        if again:
            # uvicorn's second Ctrl-C cuts every stream; here the second signal of either kind ends the requests
            # with their reason first (their streams then close by themselves), and only a third cuts.
            self.force_exit = self.hurry
            self.hurry = True

    async def shutdown(self, sockets=None) -> None:
        ender = asyncio.create_task(self._end_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_after_grace(self) -> None:
        if self.dispatcher.requests and self.grace_s > 0:
            logger.info("shutting down: %d request(s) may finish within %g s", len(self.dispatcher.requests),
                        self.grace_s)
        end = time.monotonic() + self.grace_s
        while time.monotonic() < end and not self.hurry:
            await asyncio.sleep(0.05)
        n = self.dispatcher.end_all("the coordinator is shutting down")
        if n:
            logger.warning("shutting down: %d request(s) ended unfinished", n)


def run_coordinator(args: CoordinatorArgs) -> None:
    try:
        app = create_app(args)
    except (ValueError, FileNotFoundError) as e:  # a model that cannot be served: say which, no traceback
        raise SystemExit(f"pdserve coordinator: {e}") from None
    # uvicorn's own limit is a backstop: ended requests leave within moments of the grace.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30,
                            timeout_graceful_shutdown=args.graceful_shutdown_timeout_s + 5)
    _DrainingServer(config, app.state.coordinator.dispatcher, args.graceful_shutdown_timeout_s).run()

