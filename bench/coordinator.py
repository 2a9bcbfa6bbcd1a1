"""How many streamed tokens one coordinator process turns into HTTP, with the workers out of the way.

    python3 -m bench.coordinator [--runs 64@10,256@0] [--tokens 256] [--clients 8] [--smoke]

A real coordinator process (`pdserve coordinator`, the embedded model's tokenizer) fronts a stand-in colocated
worker that answers each Generate with tokens as fast as the coordinator takes them: one TokenBatch a "step"
holding a token for every request it runs, as a decode worker sends them. The tokens are those of real text,
so detokenization does its real work. Clients stream `/v1/completions` (SSE, one chunk a token) or ask without
streaming. The figure that matters is the coordinator's CPU time per token (its own process, from /proc), which
does not depend on how many cores the clients and the stand-in take: its inverse is how many tokens a second
one coordinator core can serve, to set against what the decode pool behind it produces. With `--clients K`
the requests come from K client processes, so that on a machine with the cores for them the clients stop
being the bound and the tokens/s seen with the coordinator busy is its ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import zmq

from engine.protocol import (Abort, Generate, Heartbeat, KVLayout, Lease, LivePeers, PeerLeft, TokenBatch, TokenDelta,
                             WorkerInfo, WorkerLoad, decode, encode)

TEXT = ("The history of the railway begins with wagonways in the sixteenth century, where horses pulled carts "
        "along wooden rails. Steam locomotives arrived in the early nineteenth century; within fifty years a "
        "network of lines crossed every industrial country, moving coal, grain, letters and people at speeds "
        "nobody had travelled before. Timetables, standard time zones and the telegraph followed from it. ")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class StandIn(threading.Thread):
    """A colocated worker without a model: every request gets the text's tokens, one per step, to max_tokens.
    It steps as fast as the coordinator's socket takes the batches (a full PUSH queue blocks it)."""

    def __init__(self, coordinator_addr: str, token_ids: list[int]):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind("tcp://127.0.0.1:*")
        self.addr = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.beat = self.ctx.socket(zmq.PUSH)
        self.beat.connect(coordinator_addr)
        self.replies: dict[str, zmq.Socket] = {}
        self.ids = token_ids
        self.running: dict[str, list] = {}  # rid -> [reply_to, tokens sent, max_tokens]
        self.stop = threading.Event()
        self.info = WorkerInfo("stand-in", "colocated", "127.0.0.1", self.addr, "default",
                               KVLayout(30, 16, 3, 64, "float32"), 1 << 20, 8192, load=WorkerLoad(total_pages=65536))
        self.steps = 0
        self.step_s = 0.0  # a step at most this often (0: as fast as the coordinator's socket takes them)

    def run(self) -> None:
        last_beat = 0.0
        next_step = 0.0
        while not self.stop.is_set():
            if time.monotonic() - last_beat > 0.5:
                self.beat.send(encode(Heartbeat(self.info)))
                last_beat = time.monotonic()
            while self.pull.poll(0 if self.running else 50):
                msg = decode(self.pull.recv())
                if isinstance(msg, Generate):
                    self.running[msg.rid] = [msg.reply_to, 0, msg.params.get("max_tokens") or 16]
                elif isinstance(msg, Abort):
                    self.running.pop(msg.rid, None)
                elif not isinstance(msg, (LivePeers, PeerLeft, Lease)):
                    raise RuntimeError(f"stand-in worker: unexpected {type(msg).__name__}")
            if self.running:
                wait = next_step - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                next_step = max(next_step + self.step_s, time.monotonic()) if self.step_s else 0.0
                self.step()

    def step(self) -> None:
        batches: dict[str, list[TokenDelta]] = {}
        for rid, r in list(self.running.items()):
            reply_to, sent, most = r
            done = sent + 1 >= most
            batches.setdefault(reply_to, []).append(TokenDelta(
                rid, [self.ids[sent % len(self.ids)]], finish_reason="length" if done else None,
                cached_tokens=0))
            r[1] += 1
            if done:
                del self.running[rid]
        for reply_to, items in batches.items():
            sock = self.replies.get(reply_to)
            if sock is None:
                sock = self.replies[reply_to] = self.ctx.socket(zmq.PUSH)
                sock.connect(reply_to)
            sock.send(encode(TokenBatch("stand-in", items)))
        self.steps += 1


async def load(url: str, streams: int, tokens: int, stream: bool) -> tuple[int, int, float]:
    """`streams` requests at once, each for `tokens` tokens; returns (tokens, chunks received, seconds)."""
    body = {"prompt": "Tell me about railways.", "max_tokens": tokens, "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one() -> tuple[int, int]:
            if not stream:
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"], 1
            chunks, usage = 0, None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            usage = event["usage"]
                        else:
                            chunks += 1
            return usage["completion_tokens"], chunks

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(streams)))
        return sum(t for t, _ in counts), sum(c for _, c in counts), time.perf_counter() - t0


def _load_in_process(url: str, streams: int, tokens: int, stream: bool) -> tuple[int, int, float]:
    return asyncio.run(load(url, streams, tokens, stream))


def load_from(pool, clients: int, url: str, streams: int, tokens: int, stream: bool) -> tuple[int, int, float]:
    """`streams` requests split over `clients` processes of `pool` (or this one), all at once."""
    if pool is None:
        return asyncio.run(load(url, streams, tokens, stream))
    shares = [streams // clients + (i < streams % clients) for i in range(clients)]
    t0 = time.perf_counter()
    futures = [pool.submit(_load_in_process, url, n, tokens, stream) for n in shares if n]
    counts = [f.result() for f in futures]
    return sum(c[0] for c in counts), sum(c[1] for c in counts), time.perf_counter() - t0


def parse_runs(spec: str) -> list[tuple[int, float, bool]]:
    """"64@10,256@0n" -> [(64 requests, a step every 10 ms, streamed), (256, as fast as taken, not streamed)]."""
    runs = []
    for item in spec.split(","):
        streams, _, rest = item.partition("@")
        runs.append((int(streams), float(rest.rstrip("n") or 0), not rest.endswith("n")))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="1@0,64@10,256@20,256@10,256@0,256@0n",
                    help="REQUESTS@STEP_MS, comma-separated: that many requests at once, the stand-in worker "
                         "stepping at most every STEP_MS (0: as fast as the coordinator takes the tokens); "
                         "a trailing n: not streamed")
    ap.add_argument("--tokens", type=int, default=256, help="tokens each request asks for")
    ap.add_argument("--clients", type=int, default=1, help="client processes the requests are split over")
    ap.add_argument("--smoke", action="store_true", help="a few small runs (CI)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--tokenizer", default=None,
                    help="a directory with tokenizer.json (default: the embedded model's), for machines without it")
    args = ap.parse_args()
    if args.clients < 1:
        ap.error("--clients must be >= 1")
    runs = parse_runs(args.runs)
    if args.smoke:
        runs, args.tokens = parse_runs("1@0,8@5,8@0n"), 32

    from engine.loader import resolve_model_dir
    from engine.tokenizer import Tokenizer

    model = []
    if args.tokenizer:  # the coordinator reads a model directory: the 0.5B's config with this vocabulary
        import tempfile

        from bench.pd import model_dir_for

        here = os.path.dirname(os.path.abspath(__file__))
        model = ["--model-path", model_dir_for(os.path.join(here, "configs", "qwen2.5-0.5b.json"), args.tokenizer,
                                               tempfile.mkdtemp())]
    ids = Tokenizer(model[1] if model else resolve_model_dir(None)).encode(TEXT, add_special_tokens=False)
    port, zmq_port = socket_port(), socket_port()
    coord = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "--log-level", "warning", "coordinator",
                              "--port", str(port), "--zmq-port", str(zmq_port), *model],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker = StandIn(f"tcp://127.0.0.1:{zmq_port}", ids)
    worker.start()
    url = f"http://127.0.0.1:{port}"
    rows = []
    pool = None
    if args.clients > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    try:
        wait_ready(url, coord)
        # Warm-up: connections, the first template and tokenizer calls, every client process started.
        load_from(pool, args.clients, url, 4 * args.clients, 8, True)
        for streams, step_ms, stream in runs:
            worker.step_s = step_ms / 1e3
            c0 = cpu_seconds(coord.pid)
            got, chunks, wall = load_from(pool, args.clients, url, streams, args.tokens, stream)
            cpu = cpu_seconds(coord.pid) - c0
            want = streams * args.tokens
            if got != want:
                raise SystemExit(f"{streams} requests: {got} tokens of {want}")
            rows.append({"streams": streams, "step_ms": step_ms, "stream": stream, "tokens": got, "wall_s": wall,
                         "offered_per_s": streams / (step_ms / 1e3) if step_ms else None,
                         "tokens_per_s": got / wall, "chunks_per_token": chunks / got, "cpu_s": cpu,
                         "cpu_us_per_token": cpu / got * 1e6, "busy": cpu / wall})
            print(rows[-1], flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
        worker.stop.set()
        coord.terminate()
        coord.wait(timeout=20)
    print(f"\nOne coordinator process; {args.tokens} tokens a request; {os.cpu_count()} cores, shared with "
          f"{args.clients} client process(es) and the stand-in worker:\n")
    print("| requests at once | worker step | streamed | tokens/s offered | tokens/s seen | chunks a token "
          "| coordinator CPU us a token | coordinator CPU busy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        step = f"{r['step_ms']:g} ms" if r["step_ms"] else "as taken"
        offered = f"{r['offered_per_s']:,.0f}" if r["offered_per_s"] else "-"
        print(f"| {r['streams']} | {step} | {'yes' if r['stream'] else 'no'} | {offered} | {r['tokens_per_s']:,.0f} "
              f"| {r['chunks_per_token']:.2f} | {r['cpu_us_per_token']:.1f} | {r['busy']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def socket_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the coordinator exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the coordinator never became ready")


if __name__ == "__main__":
    main()
