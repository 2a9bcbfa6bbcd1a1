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
