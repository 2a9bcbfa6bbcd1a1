"""The worker registry behaves the same in memory and in a real Redis."""

from __future__ import annotations

import time

import pytest

from cluster import RedisServer
from coordinator.registry import MemoryRegistry, RedisRegistry
from engine.protocol import KVLayout, WorkerInfo, WorkerLoad


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    yield server.url
    server.stop()


def info(wid: str, role: str, running: int = 0) -> WorkerInfo:
    return WorkerInfo(wid, role, "127.0.0.1", f"tcp://127.0.0.1:{5000 + len(wid)}", "m",
                      KVLayout(2, 16, 2, 8, "float32"), 1024, 512, {"tcp": b"tcp://x:1"}, WorkerLoad(running=running))


@pytest.fixture(params=["memory", "redis"])
def registry(request, redis_url):
    reg = MemoryRegistry(ttl_s=0.5) if request.param == "memory" else \
        RedisRegistry(redis_url, ttl_s=0.5, prefix=f"test{time.time_ns()}")
    yield reg
    reg.close()


def test_workers_appear_refresh_and_expire(registry):
    registry.put(info("p1", "prefill"))
    registry.put(info("d1", "decode", running=3))
    assert sorted(w.worker_id for w in registry.alive()) == ["d1", "p1"]
    assert [w.load.running for w in registry.by_role("decode")] == [3]
    assert registry.by_role("decode")[0].transfer == {"tcp": b"tcp://x:1"}
    for _ in range(4):  # p1 keeps beating; d1 went silent
        time.sleep(0.2)
        registry.put(info("p1", "prefill"))
    assert [w.worker_id for w in registry.alive()] == ["p1"]
    registry.remove("p1")
    assert registry.alive() == []


def test_a_redis_restart_does_not_make_every_worker_look_dead(tmp_path):
    """Redis comes back from a restart empty, and each worker's entry only with its next heartbeat: for a TTL
    after the restart the workers seen before still count as alive (else every request in flight would be
    placed again), one that does not beat again by then is gone, and those that do are seen afresh."""
    import shutil
    import subprocess

    from cluster import free_port

    port = free_port()

    def server():
        return subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)

    def wait_up(reg):
        for _ in range(200):
            try:
                return reg.client.ping()
            except Exception:
                time.sleep(0.05)

    proc = server()
    reg = RedisRegistry(f"redis://127.0.0.1:{port}/0", ttl_s=1.0)
    try:
        wait_up(reg)
        reg.put(info("p1", "prefill"))
        reg.put(info("d1", "decode"))
        assert sorted(w.worker_id for w in reg.alive()) == ["d1", "p1"]
        proc.terminate()
        proc.wait(timeout=10)
        proc = server()
        wait_up(reg)
        assert sorted(w.worker_id for w in reg.alive()) == ["d1", "p1"], "seconds after the restart: both"
        reg.put(info("p1", "prefill", running=2))  # p1 beats again; d1 never does
        assert {w.worker_id: w.load.running for w in reg.alive()} == {"p1": 2, "d1": 0}
        time.sleep(1.1)
        reg.put(info("p1", "prefill", running=2))
        assert [w.worker_id for w in reg.alive()] == ["p1"], "a TTL on, only the worker that beat again"
    finally:
        reg.close()
        proc.terminate()
        proc.wait(timeout=10)
