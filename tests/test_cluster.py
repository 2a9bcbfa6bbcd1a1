"""The disaggregated service end to end: real processes, real HTTP, the official openai client, real Redis,
real NIXL (UCX over host memory), the embedded SmolLM2 model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from cluster import ROOT, Cluster, RedisServer, assert_pools_clean

MODEL = "SmolLM2-135M-Instruct"
SHARED = ("You are a careful assistant for a railway company. Answer questions about timetables, tickets, "
          "delays and refunds in one short sentence, politely, and never invent facts. ") * 3
PROMPTS = [
    "The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "Water boils at", "A haiku about the sea:\n", "Translate to French: cheese ->",
    "The largest planet in the solar system is", "Q: What is 12 times 12?\nA:", "import numpy as np\n",
    "Dear customer, we are sorry", "Ünïcödé and emojis 🚀 are", "The recipe needs flour, eggs and",
    SHARED + "Q: Is the 8:15 train late?", SHARED + "Q: Can I get a refund?", SHARED + "Q: Where is platform 4?",
    SHARED + "Q: Do children travel free?", "In 1969, astronauts", "The quick brown fox",
]
MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embedded_converted():
    # Convert the GGUF once, so the processes below share the cached conversion.
    from engine.loader import resolve_model_dir

    resolve_model_dir(None)


def start(tmp_path_factory, **kw) -> Cluster:
    c = Cluster(str(tmp_path_factory.mktemp("cluster")), **kw)
    try:
        return c.wait_ready()
    except Exception:
        c.stop()
        raise


def generate(c: Cluster, prompt: str, params=GREEDY) -> dict:
    with c.client() as h:
        r = h.post("/generate", json={"text": prompt, "sampling_params": params})
        assert r.status_code == 200, r.text
        return r.json()


def run_prompts(c: Cluster, parallel: int = 1) -> list[list[int]]:
    with ThreadPoolExecutor(parallel) as pool:
        return [r["output_ids"] for r in pool.map(lambda p: generate(c, p), PROMPTS)]


def stream_completion(c: Cluster, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, dict]:
    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key=c.api_key or "none")
    text, usage = "", None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    return text, usage


@pytest.fixture(scope="module")
def reference(tmp_path_factory, embedded_converted):
    """Greedy outputs of the colocated worker, the baseline every disaggregated shape must reproduce."""
    c = start(tmp_path_factory, colocated=1)
    try:
        ids = run_prompts(c)
        texts = [stream_completion(c, p)[0] for p in PROMPTS[:4]]
        assert_pools_clean(c)
    finally:
        c.stop()
    return {"ids": ids, "texts": texts}


SHAPES = [
    pytest.param(dict(prefill=1, decode=1, backend="tcp"), "memory", id="1p1d-tcp-embedded"),
    pytest.param(dict(prefill=1, decode=1, backend="nixl"), "redis", id="1p1d-nixl-redis"),
]


@pytest.mark.parametrize("shape, registry", SHAPES)
def test_1p1d_matches_colocated(tmp_path_factory, reference, redis_server, shape, registry):
    c = start(tmp_path_factory, redis_url=redis_server.url if registry == "redis" else None, **shape)
    try:
        assert run_prompts(c) == reference["ids"]
        assert [stream_completion(c, p)[0] for p in PROMPTS[:4]] == reference["texts"]
        # Metrics parse as Prometheus text, with a sample per request and per-worker figures.
        from prometheus_client.parser import text_string_to_metric_families

        with c.client() as h:
            families = {f.name: f for f in text_string_to_metric_families(h.get("/metrics").text)}
        ttft_count = next(s.value for s in families["pdserve_time_to_first_token_seconds"].samples
                          if s.name.endswith("_count"))
        assert ttft_count >= len(PROMPTS)
        for name in ("pdserve_inter_token_latency_seconds", "pdserve_e2e_request_latency_seconds",
                     "pdserve_requests", "pdserve_prompt_tokens", "pdserve_generation_tokens",
                     "pdserve_queue_depth", "pdserve_running_requests", "pdserve_kv_pool_usage_ratio",
                     "pdserve_prefix_cache_hit_tokens", "pdserve_kv_transfer_bytes", "pdserve_kv_transfer_failures",
                     "pdserve_worker_outbox_backlog", "pdserve_worker_draining"):
            assert name in families, name
        assert all(s.value == 0 for s in families["pdserve_worker_outbox_backlog"].samples), "a coordinator keeping up"
        assert [s.value for s in families["pdserve_worker_draining"].samples] == [0, 0]
        sent = [s for s in families["pdserve_kv_transfer_bytes"].samples if s.labels["role"] == "prefill"]
        assert sent and sent[0].value > 0
        # The prefix shared by four prompts was found in the prefill worker's cache.
        prefill = next(w for w in c.workers() if w["role"] == "prefill")
        assert prefill["load"]["prefix_hit_tokens"] >= 3 * 64
        assert prefill["load"]["transfer_count"] >= len(PROMPTS)
        assert_pools_clean(c)
    finally:
        c.stop()


@contextlib.contextmanager
def decoding(c: Cluster, prompt: str, running):
    """A long greedy stream through `c`'s coordinator, from when its first token is out and `running()` (the
    decode worker's count, once its heartbeats have told the registry) says it decodes: the stream's lines."""
    with c.client() as h, h.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        while not running():
            time.sleep(0.1)
        yield lines


def test_two_coordinators_over_one_redis_serve_the_same_workers_at_once(tmp_path_factory, reference, redis_server):
    """Front doors scale out: a second coordinator on the same Redis registry finds the same workers, and
    requests sent through both at once, interleaved in the workers' batches, each come back to the coordinator
    that placed them with the colocated run's tokens; nothing is left behind in either pool. When one of them
    dies mid-stream, the workers end its requests once its lease runs out, and the other serves on; one stopped
    in order ends its requests itself, and its clients read why."""
    a = start(tmp_path_factory, prefill=1, decode=1, backend="tcp", redis_url=redis_server.url)
    b = Cluster(str(tmp_path_factory.mktemp("cluster")), redis_url=redis_server.url, backend="tcp",
                coordinator_args=["--lease-timeout", "3"])
    g = Cluster(str(tmp_path_factory.mktemp("cluster")), redis_url=redis_server.url, backend="tcp",
                coordinator_args=["--graceful-shutdown-timeout", "60"])
    try:
        deadline = time.time() + 60
        for c in (b, g):
            while True:
                try:
                    if len(c.workers()) == 2:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                assert time.time() < deadline, "another coordinator never saw the workers"
                time.sleep(0.3)
        doors = [a, b] * len(PROMPTS)
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: generate(doors[i], PROMPTS[i % len(PROMPTS)])["output_ids"],
                                 range(2 * len(PROMPTS))))
        assert outs[:len(PROMPTS)] == reference["ids"] and outs[len(PROMPTS):] == reference["ids"]
        assert_pools_clean(a)
        assert_pools_clean(b)

        def running() -> int:
            return next(w for w in a.workers() if w["role"] == "decode")["load"]["running"]

        # SIGTERM a coordinator while a long request streams through it (minutes of decoding here): within its
        # grace the stream goes on; a second SIGTERM ends the grace, and its client reads an error rather than
        # a cut connection, and the workers end the request at once, not when the coordinator's 15 s lease
        # would have run out.
        with decoding(g, PROMPTS[2], running) as lines:
            g.procs["coordinator"].terminate()
            # Once it has taken the signal it stops listening (a second signal sent before that might be
            # merged with the first by the OS).
            deadline = time.time() + 10
            while True:
                try:
                    with g.client() as h:
                        h.get("/health", timeout=1)
                except httpx.TransportError:
                    break
                assert time.time() < deadline, "the coordinator still takes connections after SIGTERM"
                time.sleep(0.05)
            more = [next(lines) for _ in range(6)]
            assert all(line.startswith("data: {") or not line for line in more), more
            g.procs["coordinator"].terminate()
            t_term = time.time()
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.time() - t_term < 3
        assert "the coordinator is shutting down" in rest[-2] and rest[-1] == "data: [DONE]", rest[-2:]
        g.procs["coordinator"].wait(timeout=10)
        while running():
            assert time.time() - t_term < 3, "the stopped coordinator's request ends with the second SIGTERM"
            time.sleep(0.2)
        assert_pools_clean(a)

        # SIGKILL the second coordinator while a long request streams through it.
        with decoding(b, PROMPTS[3], running):
            b.kill("coordinator")
            t_kill = time.time()
        while running():
            assert time.time() - t_kill < 3 + 5, "the dead coordinator's request ends with its lease"
            time.sleep(0.2)
        assert_pools_clean(a)
        assert generate(a, PROMPTS[0])["output_ids"] == reference["ids"][0]
    finally:
        g.stop()
        b.stop()
        a.stop()


@pytest.mark.parametrize("backend, registry", [("nixl", "memory"), ("tcp", "redis")])
def test_2p2d_matches_colocated_and_survives_worker_loss(tmp_path_factory, reference, redis_server, backend,
                                                         registry):
    c = start(tmp_path_factory, prefill=2, decode=2, backend=backend,
              redis_url=redis_server.url if registry == "redis" else None,
              worker_args=["--graceful-shutdown-timeout", "60"])  # (a 120-token stream takes 15 s here)
    try:
        # Two at a time: each pair of requests spreads over both prefill and both decode workers.
        assert run_prompts(c, parallel=2) == reference["ids"]
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda p: stream_completion(c, p)[0], PROMPTS[:4])) == reference["texts"]
        used = {w["worker_id"]: w["load"]["transfer_count"] for w in c.workers() if w["role"] == "prefill"}
        assert all(n > 0 for n in used.values()), used
        assert_pools_clean(c)

        # SIGKILL one decode worker while long requests stream on both.
        def long_stream(i):
            with c.client() as h, h.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": PROMPTS[i], "max_tokens": 120, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
                worker = r.headers["x-pdserve-worker"]
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
                return worker, events

        decodes = [w for w, role in c.roles.items() if role == "decode"]
        victim = decodes[0]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(long_stream, i) for i in range(4)]
            time.sleep(2.5)
            t_kill = time.time()
            c.kill(victim)
            while any(w["worker_id"] == victim for w in c.workers()):
                time.sleep(0.1)
            assert time.time() - t_kill < 3.0, "a dead worker must leave the registry within 3 s"
            results = [f.result(timeout=120) for f in futures]
        assert any(w != victim for w, _ in results), "some requests ran on the surviving decode worker"
        assert any(w == victim for w, _ in results), "some requests ran on the victim"
        # Every stream completes: those on the victim are placed again with the tokens they had streamed
        # as part of their prompt, and go on from there on the survivor.
        for w, events in results:
            assert events[-1] == "data: [DONE]" and not any("error" in e for e in events), (w, events[-3:])
            assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 120
        from prometheus_client.parser import text_string_to_metric_families

        def samples(name: str) -> list:
            with c.client() as h:
                families = {f.name: f for f in text_string_to_metric_families(h.get("/metrics").text)}
            return families[name].samples

        def placed_again() -> float:
            return sum(s.value for s in samples("pdserve_requests_placed_again"))

        assert placed_again() == sum(1 for w, _ in results if w == victim)
        assert generate(c, PROMPTS[0])["output_ids"] == reference["ids"][0]

        # The prefill workers let go of the dead decode worker (the coordinator's PeerLeft): once both have
        # sent to the survivor, each holds that one peer alone, not a connection or mapping to the dead one.
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda p: generate(c, p)["output_ids"], PROMPTS[:4]))
        assert outs == reference["ids"][:4]
        deadline = time.time() + 5
        while time.time() < deadline:
            peers = [w["load"]["transfer_peers"] for w in c.workers() if w["role"] == "prefill"]
            if peers == [1, 1]:
                break
            time.sleep(0.2)
        assert peers == [1, 1], peers

        # The same for a prefill worker.
        victim = next(w for w, role in c.roles.items() if role == "prefill")
        t_kill = time.time()
        c.kill(victim)
        while any(w["worker_id"] == victim for w in c.workers()):
            time.sleep(0.1)
        assert time.time() - t_kill < 3.0
        assert generate(c, PROMPTS[1])["output_ids"] == reference["ids"][1]
        assert_pools_clean(c)

        # SIGTERM the last decode worker while it streams: it drains (takes nothing new, so the cluster is not
        # ready), finishes the stream in full where it is, and exits once idle.
        last = next(w["worker_id"] for w in c.workers() if w["role"] == "decode")
        before = placed_again()
        with ThreadPoolExecutor(1) as pool:
            f = pool.submit(long_stream, 5)
            while not next(w for w in c.workers() if w["worker_id"] == last)["load"]["running"]:
                time.sleep(0.05)
            c.procs[last].terminate()
            while httpx.get(f"{c.url}/health/ready").status_code != 503:
                time.sleep(0.05)
            assert {s.labels["worker"]: s.value for s in samples("pdserve_worker_draining")}[last] == 1
            worker, events = f.result(timeout=60)
        assert worker == last and events[-1] == "data: [DONE]" and not any("error" in e for e in events), events[-3:]
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 120
        assert c.procs[last].wait(timeout=10) == 0
        assert placed_again() == before, "nothing was placed again"
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, embedded_converted):
    c = start(tmp_path_factory, prefill=1, decode=1, backend="tcp", api_key="sk-test",
              coordinator_args=["--max-request-bytes", str(4 << 20)])
    yield c
    c.stop()


def test_64_concurrent_streams_complete_and_are_well_formed(cluster):
    async def one(client, i):
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, "temperature": 0.8,
                "seed": i, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines() if line]
        assert all(line.startswith("data: ") for line in lines)
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert events[-1]["usage"]["completion_tokens"] == 16
        finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        return "".join(e["choices"][0]["text"] for e in events if e["choices"])

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, headers=cluster.headers, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    texts = asyncio.run(main())
    assert len(texts) == 64 and all(texts)
    assert_pools_clean(cluster)


def test_continuous_usage_counts_the_tokens_each_chunk_carries(cluster):
    """stream_options.continuous_usage_stats: every chunk carries the usage so far, so what it grew by is the
    number of tokens in the chunk (tokens that queued up while the stream waited leave together): here, the
    chunk's own logprob entries. The last count is the request's."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with cluster.client() as h, h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    chunks, final = [e for e in events if e["choices"]], events[-1]
    assert not final["choices"] and final["usage"]["completion_tokens"] == 24
    so_far = 0
    for c in chunks:
        assert c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"]
        grew = c["usage"]["completion_tokens"] - so_far
        assert grew == len(c["choices"][0]["logprobs"]["tokens"]) >= 1
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
        so_far += grew
    assert so_far == 24


def test_n_samples_and_batched_prompts_are_choices_of_one_response(cluster):
    """Choice i * n + j is sample j of prompt i: the same as that prompt alone with seed + j."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-test")
    prompts = [PROMPTS[3], PROMPTS[6]]
    params = dict(model=MODEL, max_tokens=10, temperature=0.9, seed=41, extra_body={"ignore_eos": True})
    both = client.completions.create(prompt=prompts, n=3, **params)
    assert [c.index for c in both.choices] == list(range(6))
    alone = {(i, j): client.completions.create(prompt=prompts[i], **dict(params, seed=41 + j)).choices[0].text
             for i in range(2) for j in range(3)}
    assert [c.text for c in both.choices] == [alone[i, j] for i in range(2) for j in range(3)]
    assert len({c.text for c in both.choices[:3]}) > 1, "the samples of one prompt are drawn apart"
    lengths = [client.completions.create(prompt=p, max_tokens=1, model=MODEL).usage.prompt_tokens for p in prompts]
    assert both.usage.prompt_tokens == sum(lengths), "a prompt counts once, however many samples it has"
    assert both.usage.completion_tokens == 6 * 10

    # The samples of one prompt computed and sent it once: the others took its pages from the prefix caches of
    # the prefill worker and of the decode worker, where they share them.
    def hits():
        return {w["role"]: w["load"]["prefix_hit_tokens"] for w in cluster.workers()}

    before = hits()
    long_prompt = " ".join(f"item {i} weighs {i * 7 % 13} kg;" for i in range(40))
    four = client.completions.create(prompt=long_prompt, n=4, **dict(params, max_tokens=2))
    pages = (four.usage.prompt_tokens - 1) // 16 * 16
    assert four.usage.prompt_tokens_details.cached_tokens == pages
    for _ in range(50):  # the load figures come with the workers' heartbeats
        gained = {role: n - before[role] for role, n in hits().items()}
        if min(gained.values()) >= 3 * pages:
            break
        time.sleep(0.1)
    assert gained["prefill"] >= 3 * pages and gained["decode"] >= 3 * pages

    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=8, temperature=0.9, seed=3)
    stream = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=8, temperature=0.9,
                                            seed=3, stream=True)
    texts, finishes = ["", ""], [None, None]
    for part in stream:
        for c in part.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.message.content for c in chat.choices]
    assert finishes == [c.finish_reason for c in chat.choices]
    assert_pools_clean(cluster)


def test_best_of_returns_the_samples_of_highest_mean_logprob(cluster):
    """best_of draws that many samples of each prompt (sample j as the prompt alone with seed + j) and returns
    the n whose tokens have the highest mean logprob, best first; usage counts every token drawn."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-test")
    params = dict(model=MODEL, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=[PROMPTS[1], PROMPTS[2]], n=2, best_of=4, seed=7, **params)
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and all(c.logprobs is None for c in out.choices)
    for i, prompt in enumerate([PROMPTS[1], PROMPTS[2]]):
        drawn = [client.completions.create(prompt=prompt, seed=7 + j, logprobs=0, **params).choices[0]
                 for j in range(4)]
        ranked = sorted(drawn, key=lambda c: sum(c.logprobs.token_logprobs) / 6, reverse=True)
        assert [c.text for c in out.choices[2 * i:2 * i + 2]] == [c.text for c in ranked[:2]]
    assert out.usage.completion_tokens == 2 * 4 * 6
    assert_pools_clean(cluster)


def test_echo_scores_the_prompt_as_an_evaluation_harness_asks(cluster):
    """Loglikelihood requests as lm-eval sends them: token-id prompts in a batch, echo, logprobs, one token.
    A prompt token's logprob is the one the model gives it when it generates that token."""
    from engine.loader import resolve_model_dir
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_dir(None))
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-test")
    ctx_ids = tok.encode(PROMPTS[0])
    gen = client.completions.create(model=MODEL, prompt=ctx_ids, max_tokens=6, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True}).choices[0]
    cont_ids = generate(cluster, PROMPTS[0], {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})["output_ids"]
    other = tok.encode(PROMPTS[9])
    out = client.completions.create(model=MODEL, prompt=[ctx_ids + cont_ids, other], max_tokens=1, temperature=0,
                                    logprobs=1, echo=True)
    first, second = out.choices
    assert first.text.startswith(PROMPTS[0]) and second.text.startswith(PROMPTS[9])
    lps = first.logprobs
    assert len(lps.tokens) == len(ctx_ids) + 6 + 1 and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    scored = lps.token_logprobs[len(ctx_ids):-1]
    assert scored == pytest.approx(gen.logprobs.token_logprobs, abs=2e-3)
    assert lps.tokens[len(ctx_ids):-1] == gen.logprobs.tokens
    assert all(len(t) == 1 for t in lps.top_logprobs[1:])
    assert len(second.logprobs.tokens) == len(other) + 1
    alone = client.completions.create(model=MODEL, prompt=[ctx_ids + cont_ids], max_tokens=0, logprobs=1, echo=True)
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx(lps.token_logprobs[:-1], abs=1e-4)
    assert alone.choices[0].finish_reason == "length" and alone.usage.completion_tokens == 0
    parts = list(client.completions.create(model=MODEL, prompt=ctx_ids, max_tokens=0, logprobs=0, echo=True,
                                           stream=True))
    assert "".join(c.text for part in parts for c in part.choices) == tok.decode(ctx_ids)
    assert sum(len(c.logprobs.tokens) for part in parts for c in part.choices) == len(ctx_ids)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPTS[0]) and plain.choices[0].logprobs is None
    # n samples: the first scores the prompt for all of them, whole or streamed.
    n = len(ctx_ids) + 6
    three = client.completions.create(model=MODEL, prompt=[ctx_ids + cont_ids], max_tokens=2, logprobs=1, echo=True,
                                      n=3, temperature=1.0, seed=5)
    for c in three.choices:
        assert c.logprobs.token_logprobs[:n] == pytest.approx(alone.choices[0].logprobs.token_logprobs, abs=1e-4)
    streamed = {}
    for part in client.completions.create(model=MODEL, prompt=[ctx_ids + cont_ids], max_tokens=2, logprobs=1,
                                          echo=True, n=3, temperature=1.0, seed=5, stream=True):
        for c in part.choices:
            streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert sorted(streamed) == [0, 1, 2]
    for lps in streamed.values():
        assert lps[:n] == pytest.approx(alone.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert_pools_clean(cluster)


def test_text_offset_places_each_token_in_the_choice_text(cluster):
    """Legacy logprobs' text_offset: token k's text starts at text_offset[k] of the choice's text, echoed
    prompt included, and a stream's chunks count on from the text sent before them."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-test")
    params = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=0)
    for echo in (False, True):
        c = client.completions.create(echo=echo, **params).choices[0]
        lp = c.logprobs
        assert lp.text_offset[0] == 0 and len(lp.text_offset) == len(lp.tokens) > 1
        for tok, off in zip(lp.tokens, lp.text_offset):
            assert c.text[off:off + len(tok)] == tok
        offsets = [off for part in client.completions.create(echo=echo, stream=True, **params)
                   for ch in part.choices for off in ch.logprobs.text_offset]
        assert offsets == lp.text_offset


def test_logit_bias_bans_and_forces_tokens(cluster):
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    plain = generate(cluster, PROMPTS[0], params)["output_ids"]
    banned = generate(cluster, PROMPTS[0], dict(params, logit_bias={str(plain[0]): -100}))["output_ids"]
    assert banned[0] != plain[0]
    forced = generate(cluster, PROMPTS[0], dict(params, logit_bias={"1812": 100}))["output_ids"]
    assert forced == [1812] * 4
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-test")
    comp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0,
                                     logit_bias={"1812": 100}, extra_body={"ignore_eos": True}).choices[0]
    assert len(set(comp.logprobs.tokens)) == 1
    assert all(lp < -1 for lp in comp.logprobs.token_logprobs), "logprobs are the model's, before the bias"
    assert_pools_clean(cluster)


def test_openai_client_chat_and_completion(cluster):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-test")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                          "What is the capital of France?"}], max_tokens=30, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens > 0 and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    parts = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                                "What is the capital of France?"}], max_tokens=30, temperature=0,
                                                stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     logprobs=2, stop=[" Paris"])
    choice = comp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert " Paris" not in choice.text
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    a = client.completions.create(model=MODEL, prompt="Pick a number:", max_tokens=8, temperature=1.0, seed=7)
    b = client.completions.create(model=MODEL, prompt="Pick a number:", max_tokens=8, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 129}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 9, "n": 128}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 129}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": ["hi", [1, 2]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["hi", ""]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 5}}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "skip_special_tokens": 0.5}, 400, "skip_special_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 9000}, 400, "max_tokens"),
    # Megabytes of text are refused without being tokenized (longer than any 8192 tokens can spell).
    ("/v1/completions", {"model": MODEL, "prompt": "hello world " * 100000}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 400000}]}, 400,
     "messages"),
    # JSON's escapes can spell a lone surrogate, which is no text a tokenizer takes (or msgspec sends on).
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "caf\udce9"}).encode(), 400, "prompt"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}).encode(),
     400, "messages"),
    ("/generate", json.dumps({"text": "\udfff hi", "sampling_params": {}}).encode(), 400, "text"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stop": ["ok", "\ud800"]}).encode(), 400, "stop"),
    ("/generate", {"input_ids": [70000], "sampling_params": {}}, 400, "input_ids"),
    ("/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -5}}, 400, "sampling_params"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     400, "stream_options.include_usage"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": {"continuous_usage_stats": 1}}, 400, "stream_options.continuous_usage_stats"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_input_gets_openai_error_and_service_keeps_serving(cluster, path, body, status, param):
    with cluster.client() as h:
        r = h.post(path, content=body) if isinstance(body, bytes) else h.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param
        if "word " in str(body)[:20] or len(str(body)) > 10**6:
            assert "maximum context length is 8192" in err["message"]
            assert err["code"] == "context_length_exceeded"
        ok = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_a_body_past_the_size_limit_is_refused_with_413_unread_or_as_it_arrives(cluster):
    """JSON is parsed on the event loop every stream shares, so a body over --max-request-bytes (4 MiB here)
    is refused: at once when its Content-Length says so, and part way through when it comes without one."""
    big = json.dumps({"model": MODEL, "prompt": [[7] * 1000] * 1400}).encode()  # about 4.2 MB of token ids
    assert len(big) > 4 << 20

    def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    with cluster.client() as h:
        for r in (h.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                  h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})):
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and "4,194,304 bytes" in err["message"]
        ok = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_malformed_frames_do_not_stop_any_process(cluster):
    import zmq

    ctx = zmq.Context.instance()
    targets = [f"tcp://127.0.0.1:{cluster.zmq_port}"] + [w["ctrl_addr"] for w in cluster.workers()]
    for addr in targets:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(addr)
        for junk in (b"", b"\xff\x00garbage", b"\x81\xa4type\xa5Abort", b"\x82\xa4type\xa8Allocate\xa3rid\x01"):
            s.send(junk)
        s.close()
    time.sleep(0.5)
    assert all(p.poll() is None for p in cluster.procs.values())
    assert generate(cluster, PROMPTS[0], {"temperature": 0, "max_new_tokens": 4})["output_ids"]


def test_api_key_is_required(cluster):
    r = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{cluster.url}/health").status_code == 200


def test_the_server_and_the_cli_say_the_installed_version():
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "coordinator.cli", "--version"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"pdserve {version('pdserve')}"


def test_version_needs_no_key(cluster):
    from importlib.metadata import version

    assert httpx.get(f"{cluster.url}/version").json() == {"version": version("pdserve")}


def test_client_disconnect_frees_pages_on_both_workers(cluster):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 400,
                                            "ignore_eos": True, "stream": True}),
                       ("/v1/completions", {"model": MODEL, "prompt": [PROMPTS[5], PROMPTS[7]], "n": 2,
                                            "max_tokens": 400, "ignore_eos": True, "stream": True}),
                       ("/v1/completions", {"model": MODEL, "prompt": PROMPTS[8], "n": 3, "max_tokens": 400,
                                            "ignore_eos": True}),
                       ("/v1/completions", {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 400,
                                            "ignore_eos": True})):
        with cluster.client(timeout=1.5) as h:
            try:
                with h.stream("POST", path, json=body) as r:
                    for _ in r.iter_lines():
                        break
            except httpx.ReadTimeout:
                pass  # the non-streaming request: we hang up before the answer
    time.sleep(1.0)
    assert_pools_clean(cluster)


def test_samples_waiting_for_their_first_are_dropped_when_the_client_leaves(cluster):
    """The samples of a long new prompt wait until the first has computed it; a client that hangs up
    meanwhile frees the first on both workers, and the others are never placed."""
    words = "amber basalt cobalt dune ember fjord granite harbor indigo jasper".split()
    prompt = " ".join(f"{words[i % 10]}{i * 37 % 1009}" for i in range(500))  # about 1,800 tokens, new here
    from engine.loader import resolve_model_dir
    from engine.tokenizer import Tokenizer

    n_prompt = len(Tokenizer(resolve_model_dir(None)).encode(prompt))
    assert n_prompt > 1500

    def looked_up() -> int:  # prompt tokens the decode worker has reserved pages for (a lookup each)
        return next(w for w in cluster.workers() if w["role"] == "decode")["load"]["prefix_query_tokens"]

    before = looked_up()
    with cluster.client(timeout=0.3) as h, pytest.raises(httpx.ReadTimeout):
        h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "n": 3, "max_tokens": 50})
    assert_pools_clean(cluster)
    assert looked_up() - before < 2 * n_prompt, "samples placed for a client that had left"


def test_clients_leaving_at_random_moments_leave_the_others_whole(cluster):
    """Twenty-four requests at once, streamed or not, of one to three samples, on short prompts and on long
    new ones (whose samples wait for the first), half of whose clients hang up at a random moment: waiting
    for workers, during the prefill, while samples wait, mid-stream. The others get what they get alone,
    and the workers hold nothing afterwards."""
    rng = random.Random(5)
    words = "north south river stone cloud field light glass paper metal".split()
    jobs = []
    for i in range(24):
        prompt = PROMPTS[i % len(PROMPTS)] if i % 3 else " ".join(
            f"{rng.choice(words)}{rng.randrange(1000)}" for _ in range(rng.randrange(100, 300)))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": i,
                "n": rng.choice([1, 1, 2, 3]), "ignore_eos": True, "stream": rng.random() < 0.5}
        jobs.append((body, rng.uniform(0.05, 2.0) if i % 2 else None))

    async def texts(client, body) -> list[str]:
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return [c["text"] for c in r.json()["choices"]]
        out = [""] * body["n"]
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        out[c["index"]] += c["text"]
        return out

    async def one(client, body, leave):
        if leave is None:
            return await texts(client, body)
        with contextlib.suppress(asyncio.TimeoutError):  # the timeout cancels the call: the connection closes
            await asyncio.wait_for(texts(client, body), leave)

    async def burst():
        async with httpx.AsyncClient(base_url=cluster.url, headers=cluster.headers, timeout=120) as client:
            return await asyncio.gather(*(one(client, body, leave) for body, leave in jobs))

    got = asyncio.run(burst())
    assert_pools_clean(cluster)
    with cluster.client(timeout=120) as h:
        for (body, leave), out in zip(jobs, got):
            if leave is None:
                alone = h.post("/v1/completions", json=dict(body, stream=False)).json()
                assert out == [c["text"] for c in alone["choices"]], body
    assert_pools_clean(cluster)


def test_loadgen_reports_against_the_cluster(cluster):
    out = subprocess.run([sys.executable, "-m", "loadgen", "--url", cluster.url, "--api-key", "sk-test",
                          "--num-requests", "12", "--concurrency", "4", "--input-len", "32", "--output-len", "8",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["succeeded"] == 12 and report["failed"] == 0
    assert report["ttft_s_p50"] > 0 and report["output_token_throughput"] > 0
    human = subprocess.run([sys.executable, "-m", "loadgen", "--url", cluster.url, "--api-key", "sk-test",
                            "--num-requests", "4", "--request-rate", "20", "--input-len", "16", "--output-len", "4"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert human.returncode == 0 and "TTFT (ms)" in human.stdout and "4/4 ok" in human.stdout


@pytest.mark.parametrize("flags, says", [
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--request-rate", "-1"], "--request-rate must be > 0"),
    (["--range-ratio", "1.5"], "--range-ratio must be in [0, 1]"),
    (["--url", "localhost:30000"], "--url must be an http:// or https:// URL"),
    (["--dataset", "/nowhere.json"], "loadgen: cannot read /nowhere.json"),
    (["--url", "http://127.0.0.1:9", "--num-requests", "1"], "loadgen: cannot reach http://127.0.0.1:9"),
])
def test_loadgen_refuses_what_it_cannot_run_in_one_line(flags, says):
    out = subprocess.run([sys.executable, "-m", "loadgen", *flags], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and says in out.stderr.strip().splitlines()[-1], out.stderr
    assert "Traceback" not in out.stderr


def outcomes(c: Cluster) -> dict[str, float]:
    """The coordinator's count of requests by outcome (its /metrics)."""
    text = httpx.get(f"{c.url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r'^pdserve_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def prefill_transfers(c: Cluster) -> int:
    return next(w for w in c.workers() if w["role"] == "prefill")["load"]["transfer_count"]


def test_full_decode_pool_makes_requests_wait_then_503(tmp_path_factory, embedded_converted):
    """A decode pool with room for one long prompt at a time: the next request waits for pages, and past
    the admission timeout gets 503 with Retry-After; no prefill work starts for it, nor for one whose client
    leaves while it waits."""
    from engine.loader import resolve_model_dir
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_dir(None))
    words = "ocean river mountain valley forest desert island meadow canyon glacier".split()

    def prompt(seed):  # about 380 tokens, different for each seed (so no prefix is shared)
        text = " ".join(f"{words[(seed * 7 + i * 3) % 10]}{(seed * 131 + i) % 97}" for i in range(130))
        assert 300 < len(tok.encode(text)) < 400
        return text

    c = start(tmp_path_factory, prefill=1, decode=1, backend="tcp", worker_args=["--max-total-tokens", "512"],
              coordinator_args=["--admission-timeout", "2"])
    try:
        def ask(*seeds):
            with c.client() as h:
                text = [prompt(s) for s in seeds] if len(seeds) > 1 else prompt(seeds[0])
                return h.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 100,
                                                       "ignore_eos": True, "temperature": 0})

        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask, 1)
            time.sleep(1.0)  # the first now holds most of the decode pool
            second = pool.submit(ask, 2)
            r2, r1 = second.result(timeout=120), first.result(timeout=120)
        assert r1.status_code == 200 and r1.json()["usage"]["completion_tokens"] == 100
        assert r2.status_code == 503 and r2.headers["retry-after"] == "1", r2.text
        assert r2.json()["error"]["type"] == "service_unavailable_error"
        assert prefill_transfers(c) == 1, "the rejected request never reached the prefill worker"
        assert ask(3).status_code == 200, "with the pool free again, requests get in"
        assert_pools_clean(c)
        # A client that hangs up while its request waits for pages: the request is dropped then (an abort),
        # not left to time out in the queue (a rejection) or, had pages come free first, to be computed.
        before = outcomes(c)
        with ThreadPoolExecutor(1) as pool:
            holder = pool.submit(ask, 6)
            time.sleep(1.0)
            with c.client(timeout=0.5) as h, pytest.raises(httpx.ReadTimeout):
                h.post("/v1/completions", json={"model": MODEL, "prompt": prompt(7), "max_tokens": 100})
            assert holder.result(timeout=120).status_code == 200
        after = outcomes(c)
        assert after.get("abort", 0) - before.get("abort", 0) == 1, (before, after)
        assert after.get("rejected", 0) == before.get("rejected", 0), (before, after)
        assert prefill_transfers(c) == 3, "only the requests that were answered reached the prefill worker"
        assert_pools_clean(c)
        # Two prompts in one request, of which the pool holds one at a time: the second cannot be placed, so
        # neither is served, and the one that was placed is freed.
        both = ask(4, 5)
        assert both.status_code == 503, both.text
        assert_pools_clean(c)
    finally:
        c.stop()


def test_no_worker_means_503_with_retry_after(tmp_path_factory, embedded_converted):
    c = Cluster(str(tmp_path_factory.mktemp("empty")), coordinator_args=["--admission-timeout", "1"])
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{c.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        assert httpx.get(f"{c.url}/health/ready").status_code == 503
        r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["message"]
    finally:
        c.stop()
