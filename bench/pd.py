"""The service on one GPU: TTFT of a lone long request and greedy tokens, 1P1D against one colocated worker.

    python -m bench.pd --model-dir DIR [--json rows.json]

DIR holds config.json and tokenizer.json; the workers start with `--load-format dummy`, so the weights are
random (the same seed in every process, hence the same model in the prefill, decode and colocated workers).
Each setup is a real `pdserve up` (coordinator + workers as processes, KV over cuda_ipc between the two
workers); requests go over HTTP to SGLang's /generate, streamed, one at a time so that every request runs
alone, as the TTFT figure asks and so that both setups compute each token in batches of one.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = __file__.rsplit("/bench/", 1)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir: str, colocated: bool, engine_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    shape = ["--colocated", "1"] if colocated else ["--prefill", "1", "--decode", "1"]
    cmd = [sys.executable, "-m", "coordinator.cli", "up", "--port", str(port), "--model-path", model_dir, *shape,
           "--load-format", "dummy", *engine_args]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    for line in p.stdout:
        if line.startswith("pdserve ready"):
            # Keep reading, so that the children's output never fills the pipe and blocks them.
            threading.Thread(target=p.stdout.read, daemon=True).start()
            return p, f"http://127.0.0.1:{port}"
        if time.time() > deadline:
            break
    stop(p)
    raise RuntimeError(f"`{' '.join(cmd)}` did not become ready")


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def generate(url: str, ids: list[int], max_new: int) -> tuple[float, list[int]]:
    """(seconds to the first streamed token, all output ids) of one greedy streamed /generate request."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
    req = urllib.request.Request(f"{url}/generate", body.encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, out = None, []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            msg = json.loads(line[5:])
            if "error" in msg:
                raise RuntimeError(f"server error: {msg['error']}")
            if ttft is None and msg.get("output_ids"):
                ttft = time.perf_counter() - t0
            out = msg.get("output_ids", out)
    return ttft, out


def measure(url: str, vocab: int, prompt_len: int, runs: int, prompts: list[list[int]], max_new: int) -> dict:
    rng = random.Random(0)
    # The first request after "ready" shows what the workers' own warm-up left to the first client.
    first = [generate(url, [rng.randrange(10, vocab) for _ in range(prompt_len)], 2)[0] for _ in range(3)]
    ttfts = []
    for i in range(runs):
        # A fresh prompt each time (radix cache off as well): every TTFT is a whole prefill.
        ids = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        ttfts.append(generate(url, ids, 1)[0])
    outputs = [generate(url, p, max_new)[1] for p in prompts]
    return {"ttft": ttfts, "outputs": outputs, "first": first}


def model_dir_for(config_path: str, tokenizer_dir: str, out_dir: str) -> str:
    """A model directory: the layer shapes of `config_path`, the vocabulary and tokenizer of `tokenizer_dir`."""
    import os
    import shutil

    from tokenizers import Tokenizer

    with open(config_path) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json").get_vocab_size(with_added_tokens=True)
    cfg.pop("bos_token_id", None)
    cfg.pop("eos_token_id", None)
    os.makedirs(out_dir, exist_ok=True)
    with open(f"{out_dir}/config.json", "w") as f:
        json.dump(cfg, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(f"{tokenizer_dir}/{name}"):
            shutil.copy(f"{tokenizer_dir}/{name}", out_dir)
    return out_dir


def pd_rows(model_dir: str, prompt_len: int = 4096, runs: int = 7, engine_args: list[str] | None = None) -> list:
    with open(f"{model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(1)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(20, 600))] for _ in range(8)]
    engine_args = engine_args or ["--max-total-tokens", "65536", "--cuda-graph-max-bs", "8", "--disable-radix-cache"]
    results = {}
    for name, colocated in (("colocated", True), ("1P1D", False)):
        p, url = start(model_dir, colocated, engine_args)
        try:
            results[name] = measure(url, vocab, prompt_len, runs, prompts, 32)
        finally:
            stop(p)
        print(f"  {name}: TTFT ms {[round(t * 1e3, 1) for t in results[name]['ttft']]}, the first three requests "
              f"after ready {[round(t * 1e3, 1) for t in results[name]['first']]}", flush=True)
    co, pd = (statistics.median(results[k]["ttft"]) for k in ("colocated", "1P1D"))
    same = sum(a == b for a, b in zip(results["colocated"]["outputs"], results["1P1D"]["outputs"]))
    return [(f"TTFT of a lone {prompt_len}-token request, 1P1D `pdserve up`: ms (colocated ms)", pd * 1e3,
             co * 1e3, pd / co, "<= 1.05"),
            (f"greedy tokens, 1P1D vs colocated, {len(prompts)} prompts x 32 tokens: prompts equal", same,
             len(prompts), same / len(prompts), "== 1")] + [
            (f"TTFT of the first {prompt_len}-token request after ready (the workers warmed up), {k}: ms (the "
             f"later requests' median ms)", results[k]["first"][0] * 1e3, statistics.median(results[k]["ttft"]) * 1e3,
             results[k]["first"][0] / statistics.median(results[k]["ttft"]), "(for comparison)") for k in results]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("engine_args", nargs="*", help="engine flags for every worker (after --)")
    args = ap.parse_args()
    for r in pd_rows(args.model_dir, args.prompt_len, args.runs, args.engine_args):
        print(r, flush=True)


if __name__ == "__main__":
    main()
