"""Real clusters for tests: a coordinator and workers as separate processes, on loopback ports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx

from coordinator.cli import die_with_parent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_ENGINE_ARGS = ["--max-total-tokens", "4096", "--chunked-prefill-size", "512"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, tmpdir: str):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", tmpdir], stdout=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        deadline = time.time() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except redis.ConnectionError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


class Cluster:
    def __init__(self, logdir: str, *, prefill: int = 0, decode: int = 0, colocated: int = 0,
                 redis_url: str | None = None, backend: str = "auto", model_path: str | None = None,
                 api_key: str | None = None, worker_args: list[str] | None = None,
                 coordinator_args: list[str] | None = None):
        self.logdir = logdir
        self.port = free_port()
        self.zmq_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.procs: dict[str, subprocess.Popen] = {}
        self.roles: dict[str, str] = {}
        me = [sys.executable, "-m", "coordinator.cli", "--log-level", "info"]
        model = ["--model-path", model_path] if model_path else []
        coord = me + ["coordinator", "--port", str(self.port), "--zmq-port", str(self.zmq_port),
                      "--transfer-backend", backend, "--admission-timeout", "20"] + model + (coordinator_args or [])
        if redis_url:
            coord += ["--redis-url", redis_url]
        if api_key:
            coord += ["--api-key", api_key]
        self._spawn("coordinator", coord)
        reach = ["--redis-url", redis_url] if redis_url else ["--coordinator-addr", f"tcp://127.0.0.1:{self.zmq_port}"]
        for role, n in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
            for i in range(n):
                wid = f"{role}-{i}-{uuid.uuid4().hex[:6]}"
                self.roles[wid] = role
                self._spawn(wid, me + ["worker", "--role", role, "--worker-id", wid] + reach + model
                            + WORKER_ENGINE_ARGS + (worker_args or []))
        self.expected = prefill + decode + colocated

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.logdir, f"{name}.log"), "w")
        # Children die with the test process, even when it is killed, so no cluster outlives a test run.
        self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            preexec_fn=die_with_parent)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, **{"timeout": 120, **kw})

    def workers(self) -> list[dict]:
        with self.client() as c:
            return c.get("/v1/workers").json()

    def wait_ready(self, timeout: float = 180) -> "Cluster":
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}: see {self.logdir}/{name}.log")
            try:
                if len(self.workers()) == self.expected:
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"cluster not ready in {timeout}s; logs in {self.logdir}")

    def kill(self, worker_id: str) -> None:
        self.procs[worker_id].send_signal(signal.SIGKILL)
        self.procs[worker_id].wait()

    def wait_clean(self, timeout: float = 10) -> list[dict]:
        """Wait until every worker reports an idle pool: all pages free or prefix-cached."""
        deadline = time.time() + timeout
        while True:
            ws = self.workers()
            idle = all(w["load"]["running"] == 0 and w["load"]["waiting"] == 0 and
                       w["load"]["free_pages"] + w["load"]["cached_pages"] == w["load"]["total_pages"] for w in ws)
            if idle or time.time() > deadline:
                return ws
            time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def assert_pools_clean(c: Cluster) -> None:
    """Every worker idle, with every page free or prefix-cached: no request left anything behind."""
    for w in c.wait_clean():
        ld = w["load"]
        assert ld["running"] == 0 and ld["waiting"] == 0 and ld["pending_allocations"] == 0, w["worker_id"]
        assert ld["free_pages"] + ld["cached_pages"] == ld["total_pages"], (w["worker_id"], ld)
