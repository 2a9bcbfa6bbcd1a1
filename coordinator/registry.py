"""Worker registry: who is alive, in which role, where, with what load.

Workers refresh their entry with every heartbeat; an entry not refreshed within `ttl_s` is gone. Two stores
with one behaviour: `MemoryRegistry` lives inside the coordinator (workers' heartbeats reach it over ZMQ),
`RedisRegistry` lives in Redis (workers write to it directly, any number of coordinators read it).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import msgspec

from engine.protocol import WorkerInfo

DEFAULT_TTL_S = 2.0
HEARTBEAT_INTERVAL_S = 0.5


class Registry(ABC):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S):
        self.ttl_s = ttl_s

    @abstractmethod
    def put(self, info: WorkerInfo) -> None:
        """Add or refresh a worker; it stays alive for ttl_s."""

    @abstractmethod
    def remove(self, worker_id: str) -> None: ...

    @abstractmethod
    def alive(self) -> list[WorkerInfo]: ...

    def by_role(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.alive() if w.role == role]

    def close(self) -> None:
        pass


class MemoryRegistry(Registry):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock=time.monotonic):
        super().__init__(ttl_s)
        self.clock = clock
        self._entries: dict[str, tuple[float, WorkerInfo]] = {}

    def put(self, info):
        self._entries[info.worker_id] = (self.clock() + self.ttl_s, info)

    def remove(self, worker_id):
        self._entries.pop(worker_id, None)

    def alive(self):
        now = self.clock()
        for wid in [w for w, (exp, _) in self._entries.items() if exp <= now]:
            del self._entries[wid]
        return [info for _, info in self._entries.values()]


class RedisRegistry(Registry):
    """One key per worker (`{prefix}:worker:{id}`, msgpack WorkerInfo) with a TTL set on every heartbeat."""

    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, prefix: str = "pdserve"):
        import redis

        super().__init__(ttl_s)
        self.client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.prefix = prefix
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(WorkerInfo)
        self.clock = time.monotonic
        self._run_id: str | None = None  # the Redis server's, to tell a restart
        self._restarted_at = float("-inf")
        self._last: dict[str, WorkerInfo] = {}

    def _key(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def put(self, info):
        self.client.set(self._key(info.worker_id), self._enc.encode(info), px=int(self.ttl_s * 1000))

    def remove(self, worker_id):
        self.client.delete(self._key(worker_id))

    def alive(self):
        run_id = self.client.info("server").get("run_id")
        keys = list(self.client.scan_iter(match=self._key("*"), count=1000))
        out = []
        for raw in self.client.mget(keys) if keys else []:
            if raw is None:  # expired between scan and get
                continue
            try:
                out.append(self._dec.decode(raw))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        # A Redis that restarted comes back empty, and each worker's entry returns only with its next heartbeat:
        # read as it is, every worker would look dead at once and every request in flight be placed again.
        # For a TTL after a restart, a worker seen before it still counts as alive.
        now = self.clock()
        if self._run_id is not None and run_id != self._run_id:
            self._restarted_at = now
        self._run_id = run_id
        if now - self._restarted_at < self.ttl_s:
            seen = {w.worker_id for w in out}
            out += [w for wid, w in self._last.items() if wid not in seen]
        self._last = {w.worker_id: w for w in out}
        return out

    def close(self):
        self.client.close()


def make_registry(redis_url: str | None, ttl_s: float = DEFAULT_TTL_S) -> Registry:
    return RedisRegistry(redis_url, ttl_s) if redis_url else MemoryRegistry(ttl_s)
