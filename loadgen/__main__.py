"""Load generator for any OpenAI-compatible completions endpoint.

    python -m loadgen --url http://127.0.0.1:30000 --num-requests 100 --request-rate 4
    python -m loadgen --url ... --concurrency 16 --input-len 256 --output-len 64
    python -m loadgen --url ... --dataset sharegpt.json --json

Requests stream; TTFT is the time to the first text, inter-token latency the gaps between later chunks
(divided by the tokens they carry, where the server reports usage with every chunk, as pdserve and vLLM do
for stream_options.continuous_usage_stats; one token a chunk elsewhere), end-to-end the time to [DONE].
Output token counts come from `usage`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water room mother area money story month lot right study "
         "book job word business issue side kind head house service friend father power hour game line end").split()


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str = ""


def make_requests(args) -> list[tuple[str, int]]:
    rng = random.Random(args.seed)
    if args.dataset:
        try:
            with open(args.dataset) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"loadgen: cannot read {args.dataset}: {e}")
        if not isinstance(data, list):
            sys.exit(f"{args.dataset}: a ShareGPT file is a JSON list of conversations")
        out = []
        for item in data:
            if not isinstance(item, dict):
                continue
            conv = item.get("conversations") or item.get("conversation") or []
            if isinstance(conv, list) and len(conv) >= 2 and all(isinstance(c, dict) for c in conv[:2]) \
                    and isinstance(conv[0].get("value"), str) and isinstance(conv[1].get("value"), str) \
                    and conv[0]["value"] and conv[1]["value"]:
                out.append((conv[0]["value"], max(4, int(len(conv[1]["value"].split()) * 1.3))))
        rng.shuffle(out)
        if not out:
            sys.exit(f"{args.dataset}: no usable conversations")
        return [out[i % len(out)] for i in range(args.num_requests)]
    reqs = []
    for _ in range(args.num_requests):
        n_in = rng.randint(max(1, int(args.input_len * args.range_ratio)), args.input_len)
        n_out = rng.randint(max(1, int(args.output_len * args.range_ratio)), args.output_len)
        reqs.append((" ".join(rng.choice(WORDS) for _ in range(n_in)), n_out))
    return reqs


async def one(client: httpx.AsyncClient, args, model: str, prompt: str, max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": not args.dataset, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    t0 = time.perf_counter()
    res = Result(ok=False)
    last, tokens = None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = not res.error
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = ev["error"].get("message", "error")
                    continue
                if ev.get("usage"):
                    res.prompt_tokens = ev["usage"]["prompt_tokens"]
                    res.output_tokens = ev["usage"]["completion_tokens"]
                if ev.get("choices") and ev["choices"][0].get("text"):
                    now = time.perf_counter()
                    # Tokens this chunk carries: what the running usage grew by (one, without it).
                    carried = max(1, res.output_tokens - tokens) if ev.get("usage") else 1
                    tokens = res.output_tokens
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls += [(now - last) / carried] * carried
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 1000))
    reqs = make_requests(args)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model
        if model is None:
            try:
                r = await client.get("/v1/models")
                model = r.json()["data"][0]["id"] if r.status_code == 200 else None
            except httpx.HTTPError as e:
                sys.exit(f"loadgen: cannot reach {args.url}: {type(e).__name__}: {e}")
            except (ValueError, KeyError, IndexError, TypeError):
                model = None
            if model is None:
                sys.exit(f"loadgen: {args.url}/v1/models answered {r.status_code} without a model: "
                         f"{r.text[:200]!r} (give --model, or --api-key)")
        rng = random.Random(args.seed + 1)
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        done = 0

        async def task(prompt, n):
            nonlocal done
            if sem:
                async with sem:
                    r = await one(client, args, model, prompt, n)
            else:
                r = await one(client, args, model, prompt, n)
            done += 1
            if not args.json:
                bar = int(30 * done / len(reqs))
                print(f"\r[{'#' * bar}{'.' * (30 - bar)}] {done}/{len(reqs)}", end="", file=sys.stderr, flush=True)
            return r

        t0 = time.perf_counter()
        tasks = []
        for prompt, n in reqs:
            tasks.append(asyncio.create_task(task(prompt, n)))
            if not args.concurrency and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if not args.json:
        print(file=sys.stderr)
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    report = {
        "requests": len(results), "succeeded": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration,
        "total_token_throughput": sum(r.output_tokens + r.prompt_tokens for r in ok) / duration,
    }
    for name, vals in (("ttft_s", [r.ttft for r in ok]), ("itl_s", itls), ("e2e_s", [r.e2e for r in ok])):
        for q in (50, 90, 99):
            report[f"{name}_p{q}"] = pct(vals, q)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadgen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--concurrency", type=int, default=0, help="fixed number in flight (overrides the rate)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="lengths drawn uniformly in [len*ratio, len]")
    ap.add_argument("--dataset", default=None, help="ShareGPT-format JSON file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    for name, ok, rule in (("--num-requests", args.num_requests >= 1, ">= 1"),
                           ("--request-rate", args.request_rate > 0, "> 0"),
                           ("--concurrency", args.concurrency >= 0, ">= 0"),
                           ("--input-len", args.input_len >= 1, ">= 1"),
                           ("--output-len", args.output_len >= 1, ">= 1"),
                           ("--range-ratio", 0 <= args.range_ratio <= 1, "in [0, 1]"),
                           ("--timeout", args.timeout > 0, "> 0"),
                           ("--url", args.url.startswith(("http://", "https://")), "an http:// or https:// URL")):
        if not ok:
            ap.error(f"{name} must be {rule}")
    report = asyncio.run(run(args))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{'requests':<28}{report['succeeded']}/{report['requests']} ok, {report['failed']} failed")
        for e in report["errors"]:
            print(f"{'  error':<28}{e}")
        print(f"{'duration':<28}{report['duration_s']:.2f} s")
        print(f"{'request throughput':<28}{report['request_throughput']:.2f} req/s")
        print(f"{'output token throughput':<28}{report['output_token_throughput']:.1f} tok/s")
        print(f"{'total token throughput':<28}{report['total_token_throughput']:.1f} tok/s")
        print(f"{'':<28}{'p50':>10}{'p90':>10}{'p99':>10}")
        for name, label in (("ttft_s", "TTFT (ms)"), ("itl_s", "inter-token latency (ms)"), ("e2e_s", "end-to-end (ms)")):
            print(f"{label:<28}" + "".join(f"{report[f'{name}_p{q}'] * 1000:>10.1f}" for q in (50, 90, 99)))
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
