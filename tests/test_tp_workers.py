"""Tensor-parallel workers in the cluster: a worker started with --tp 2 runs a second rank of its own, and a
1P1D cluster of such workers serves exactly what one process computes. (On CPUs, over gloo; the same code
runs NCCL on GPUs.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from cluster import Cluster, assert_pools_clean
from test_models import PROMPTS

STEPS = 10
GREEDY = {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}
SEEDED = {"temperature": 1.0, "seed": 11, "max_new_tokens": STEPS, "ignore_eos": True}


def generate(c: Cluster, ids: list[int], params: dict) -> list[int]:
    with c.client() as h:
        r = h.post("/generate", json={"input_ids": ids, "sampling_params": params})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]


def one_process(path: str) -> dict:
    """What a single engine (no tensor parallelism) generates for every prompt, greedy and seeded."""
    from engine import Engine, SamplingParams

    engine = Engine(model_path=path, max_total_tokens=4096)
    reqs = {}
    for i, p in enumerate(PROMPTS):
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            sp = SamplingParams(temperature=params["temperature"], seed=params.get("seed"), max_tokens=STEPS,
                                ignore_eos=True)
            reqs[(name, i)] = engine.add_request(p, sp)
    scored = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    while engine.has_work():
        engine.step()
    return {k: r.output_ids for k, r in reqs.items()} | {"scored": [lp.logprob for lp in scored.prompt_logprobs]}


def ranks_of(c: Cluster, worker_id: str) -> list[int]:
    """Pids of the processes a worker started: its followers."""
    out = subprocess.run(["pgrep", "-P", str(c.procs[worker_id].pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def reference(tiny_models):
    path, _ = tiny_models["llama"]
    return one_process(path)


@pytest.mark.parametrize("shape", [dict(prefill=1, decode=1, backend="tcp"), dict(prefill=1, decode=1, backend="nixl"),
                                   dict(colocated=1)], ids=["1p1d-tcp", "1p1d-nixl", "colocated"])
def test_tp2_workers_serve_what_one_process_computes(tiny_models, tmp_path, reference, shape):
    path, _ = tiny_models["llama"]
    c = Cluster(str(tmp_path), model_path=path, worker_args=["--tp", "2"], **shape)
    try:
        c.wait_ready()
        workers = c.workers()
        assert all(w["layout"]["tp_size"] == 2 and w["layout"]["kv_heads"] == 1 for w in workers), workers
        from prometheus_client.parser import text_string_to_metric_families

        with c.client() as h:
            families = {f.name: f for f in text_string_to_metric_families(h.get("/metrics").text)}
        assert sorted(s.labels["worker"] for s in families["pdserve_worker_tp_size"].samples if s.value == 2) \
            == sorted(c.roles)
        for wid in c.roles:
            assert len(ranks_of(c, wid)) == 1, "each worker runs its second rank as a child"
        if "prefill" in shape:
            # The first transfer: all 5 pages of a 70-token prompt, both ranks' KV heads counted.
            assert generate(c, PROMPTS[2], GREEDY) == reference[("greedy", 2)]
            lay = workers[0]["layout"]
            page_bytes = lay["num_layers"] * 2 * lay["page_size"] * (2 * lay["kv_heads"]) * lay["head_dim"] * 4
            deadline = time.time() + 10
            while (load := next(w["load"] for w in c.workers() if w["role"] == "prefill"))["transfer_count"] < 1:
                assert time.time() < deadline
                time.sleep(0.2)
            assert load["transfer_bytes"] == 5 * page_bytes
        for i, p in enumerate(PROMPTS):
            assert generate(c, p, GREEDY) == reference[("greedy", i)], i
            assert generate(c, p, SEEDED) == reference[("seeded", i)], i
        # Prompt logprobs: every rank computes the prompt's logits in the same slices.
        with c.client() as h:
            r = h.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 1, "temperature": 0, "echo": True,
                                                "logprobs": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["token_logprobs"][1:-1] == pytest.approx(reference["scored"],
                                                                                          abs=1e-4)
        # Several at once: the ranks batch them alike, or the collectives would not meet.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: generate(c, PROMPTS[i % len(PROMPTS)], GREEDY), range(12)))
        assert got == [reference[("greedy", i % len(PROMPTS))] for i in range(12)]
        assert_pools_clean(c)
    finally:
        c.stop()


def test_a_client_that_leaves_mid_stream_frees_pages_on_every_rank(tiny_models, tmp_path, reference):
    """Aborts reach the second ranks too: requests after the aborted ones still batch identically, so they
    still match one process, and the pools end clean."""
    path, _ = tiny_models["llama"]
    c = Cluster(str(tmp_path), model_path=path, backend="tcp", prefill=1, decode=1, worker_args=["--tp", "2"])
    try:
        c.wait_ready()
        for _ in range(3):
            with c.client() as h, h.stream("POST", "/generate", json={
                    "input_ids": PROMPTS[2], "stream": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # one chunk, then hang up
        for i, p in enumerate(PROMPTS):
            assert generate(c, p, GREEDY) == reference[("greedy", i)], i
        assert_pools_clean(c)
    finally:
        c.stop()


def test_a_lost_rank_takes_its_worker_down(tiny_models, tmp_path):
    """A group without one of its ranks cannot compute; the worker exits rather than hang, so the
    coordinator's registry drops it."""
    path, _ = tiny_models["llama"]
    c = Cluster(str(tmp_path), model_path=path, backend="tcp", colocated=1, worker_args=["--tp", "2"])
    try:
        c.wait_ready()
        wid = next(iter(c.roles))
        (rank1,) = ranks_of(c, wid)
        os.kill(rank1, signal.SIGKILL)
        c.procs[wid].wait(timeout=30)
        deadline = time.time() + 30
        while c.workers() and time.time() < deadline:
            time.sleep(0.3)
        assert c.workers() == []
        with c.client() as h:
            r = h.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY})
        assert r.status_code == 503
    finally:
        c.stop()


class _Followers:
    """Stands in for the followers of a two-rank worker: the calls they would get, and reports the test makes
    for rank 1."""

    size = 2
    reports = None

    def __init__(self):
        self.calls = []
        self.listeners = {}
        self.pending = []

    def call(self, op, *args):
        self.calls.append([op, *args])

    def collect(self):
        for r in self.pending:
            self.listeners[r.backend].on_report(r)
        self.pending = []


def wait_for(poll, timeout=5.0):
    deadline, got = time.time() + timeout, []
    while not got and time.time() < deadline:
        got = poll()
    return got


def test_the_leader_sends_rank_r_pages_to_rank_r_and_refuses_a_peer_of_another_size():
    import torch

    from engine.tp_worker import MirroredTransfer
    from kvstore import KVPool
    from transfer import create_transfer, join_rank_endpoints

    pool = KVPool(8, 16, 2, 1, 8, torch.float32, "cpu", tp_rank=0, tp_size=2)
    followers = _Followers()
    t = MirroredTransfer("tcp", create_transfer("tcp", pool, "p", "127.0.0.1"), followers)
    try:
        t.send("r1", "d", b"tcp://127.0.0.1:1", [1], [2], b"note")  # a decode worker of one rank
        (res,) = t.poll_sent()
        assert not res.ok and "1 ranks" in res.error
        assert followers.calls == [], "the refusal is the leader's alone: no rank sends"
        with pytest.raises(ValueError, match="1 ranks"):
            t.connect("d", b"tcp://127.0.0.1:1")
        assert followers.calls == [] and t.peers_held() == 0
        peer = KVPool(8, 16, 2, 1, 8, torch.float32, "cpu", tp_rank=0, tp_size=2)
        rx = create_transfer("tcp", peer, "d", "127.0.0.1")
        # Introduced ahead of its first request: each rank connects to the peer's rank of its own.
        t.connect("d", join_rank_endpoints([rx.endpoint(), b"tcp://127.0.0.1:9"]))
        assert followers.calls == [["connect", "tcp", "d", [rx.endpoint(), b"tcp://127.0.0.1:9"]]]
        assert t.peers_held() == 1
        followers.calls.clear()
        rx.expect("r2", [3])
        t.send("r2", "d", join_rank_endpoints([rx.endpoint(), b"tcp://127.0.0.1:9"]), [1], [3], b"note")
        assert followers.calls == [["send", "tcp", "r2", "d", [rx.endpoint(), b"tcp://127.0.0.1:9"], [1], [3], b"note"]]
        assert wait_for(rx.poll_received) == [("r2", b"note")], "rank 0's part went to the peer's rank 0"
        rx.close()
    finally:
        t.close()


def test_a_request_counts_as_sent_or_landed_once_every_rank_reports_its_part():
    import torch

    from engine.tp_follower import Landed, Sent
    from engine.tp_worker import MirroredTransfer
    from kvstore import KVPool
    from transfer import create_transfer, join_rank_endpoints

    src = KVPool(8, 16, 2, 1, 8, torch.float32, "cpu", tp_size=2)
    dst = KVPool(8, 16, 2, 1, 8, torch.float32, "cpu", tp_size=2)
    pf, df = _Followers(), _Followers()
    tx = MirroredTransfer("tcp", create_transfer("tcp", src, "p", "127.0.0.1"), pf)
    rx = MirroredTransfer("tcp", create_transfer("tcp", dst, "d", "127.0.0.1"), df)
    eps = join_rank_endpoints([rx._t.endpoint(), b"tcp://127.0.0.1:9"])
    try:
        for rid in ("a", "b", "c"):
            rx.expect(rid, [3])
            tx.send(rid, "d", eps, [1], [3], rid.encode())
        # Rank 0's parts are all in and sent; rank 1 has said nothing yet: nothing counts.
        time.sleep(0.3)
        assert rx.poll_received() == [] and tx.poll_sent() == []
        df.pending.append(Landed(1, "tcp", "a"))
        pf.pending += [Sent(1, "tcp", "a", True), Sent(1, "tcp", "b", False, "peer gone")]
        assert wait_for(rx.poll_received) == [("a", b"a")]
        assert [(r.rid, r.ok) for r in tx.poll_sent()] == [("a", True), ("b", False)]
        # A request forgotten meanwhile (aborted, timed out) never counts, whatever arrives later.
        rx.forget("b")
        df.pending += [Landed(1, "tcp", "b"), Landed(1, "tcp", "c")]
        assert rx.poll_received() == [("c", b"c")]
        assert rx._rank_landed == {} and rx._own_landed == {} and rx._expected == set()
    finally:
        tx.close()
        rx.close()


def test_a_worker_stuck_without_its_rank_stops_heartbeating_and_exits(monkeypatch):
    """A rank lost inside an NCCL collective leaves the main loop blocked there; the heartbeat thread must stop
    announcing the worker at once and end the process after a grace period."""
    import types

    import zmq

    import engine.worker as worker_mod

    ctx = zmq.Context()
    coord = ctx.socket(zmq.PULL)
    coord.bind("tcp://127.0.0.1:*")

    class LosesItsRank:
        lost = False

        def check(self):
            if self.lost:
                raise RuntimeError("tensor-parallel rank 1 exited with code -9")

    followers = LosesItsRank()
    w = types.SimpleNamespace(
        followers=followers, ctx=ctx, snapshot=b"",
        args=types.SimpleNamespace(redis_url=None, coordinator_addr=coord.getsockopt_string(zmq.LAST_ENDPOINT),
                                   heartbeat_interval_s=0.05))
    exits = []
    beat = worker_mod._Heartbeat(w)
    monkeypatch.setattr(beat, "rank_loss_grace_s", 0.5)
    monkeypatch.setattr(worker_mod.os, "_exit", lambda code: (exits.append((time.monotonic(), code)), beat.done.set()))
    monkeypatch.setattr(worker_mod, "encode", lambda msg: b"beat")
    beat.start()
    try:
        assert coord.poll(2000), "a healthy worker beats"
        followers.lost = True
        lost = time.monotonic()
        time.sleep(0.2)
        while coord.poll(0):
            coord.recv()  # beats sent before the loss was seen
        beat.join(timeout=5)
        assert exits and exits[0][1] == 1 and 0.5 <= exits[0][0] - lost < 2.0
        assert not coord.poll(0), "no beat after the loss"
    finally:
        beat.stop()  # closes its socket
        coord.close(0)
        ctx.term()


def test_a_tp_size_that_does_not_divide_the_model_is_refused_before_any_rank_starts(tiny_models):
    import sys

    from cluster import ROOT

    path, _ = tiny_models["llama"]
    out = subprocess.run([sys.executable, "-m", "coordinator.cli", "decode", "--tp", "3", "--model-path", path,
                          "--coordinator-addr", "tcp://127.0.0.1:9"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == "pdserve decode: --tp 3 does not divide num_attention_heads (4)"
    assert "Traceback" not in out.stderr
