"""The transfer engine interface: move a request's KV pages from a prefill pool into a decode pool.

Sender side (prefill worker): `send()` a list of source pages to destination pages, for all layers, with a
notification that the receiver gets only after all the bytes have landed; `poll_sent()` reports each send as
done or failed; once done, the sender may free its source pages.

Receiver side (decode worker): `expect()` a request before its pages can arrive; `poll_received()` returns
the notifications of requests whose KV is complete; `forget()` stops expecting a request (abort, timeout).
Whether `forget()` is final depends on the backend: a two-sided backend (tcp) writes pages itself and drops
data for requests it no longer expects, so the pages can be reused at once; a one-sided backend (nixl) lets
the sender write remotely, so pages of a forgotten request stay quarantined until its notification arrives,
the sender says it will send nothing, or the transfer timeout (past which no sender starts a write) and a
grace period pass (`one_sided`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.protocol import KVLayout


@dataclass
class TransferStats:
    bytes: int = 0
    seconds: float = 0.0
    count: int = 0
    failures: int = 0


@dataclass
class SendResult:
    rid: str
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0


class TransferEngine(ABC):
    name: str = ""
    one_sided: bool = False

    def __init__(self, pool, worker_id: str, host: str):
        self.pool = pool
        self.worker_id = worker_id
        self.host = host
        self.stats = TransferStats()
        self.layout = KVLayout.of(pool)
        # Endpoints of peers that left (drop_peer): a send still addressed to one (a prefill that was already
        # running when its decode worker died) fails at once instead of connecting to the dead worker again.
        self.departed: dict[str, bytes] = {}
        self.last_used: dict[str, float] = {}  # peer -> when a send last went to it (monotonic)

    @abstractmethod
    def endpoint(self) -> bytes:
        """What a peer needs to send to this worker (published in the registry)."""

    @abstractmethod
    def send(self, rid: str, peer_id: str, peer_endpoint: bytes, src_pages: list[int], dst_pages: list[int],
             notify: bytes) -> None: ...

    @abstractmethod
    def poll_sent(self) -> list[SendResult]: ...

    @abstractmethod
    def expect(self, rid: str, dst_pages: list[int]) -> None: ...

    @abstractmethod
    def forget(self, rid: str) -> None: ...

    @abstractmethod
    def poll_received(self) -> list[tuple[str, bytes]]:
        """(rid, notification) of every request whose pages all arrived since the last call."""

    def sockets(self) -> list:
        """ZMQ sockets the worker loop should wake up on (none for backends that progress on their own)."""
        return []

    def drop_peer(self, peer_id: str, departed: bool = True) -> None:
        """A peer left: release what this engine keeps for it. A peer whose endpoint changes under the same id
        (a restarted worker) is dropped and reconnected on the next send. departed=False: released only, so a
        send to the same endpoint later connects again instead of failing."""

    def peer_ids(self) -> list[str]:
        """The peers this engine holds something for."""
        return []

    # A peer missing from the coordinator's LivePeers is let go once it has been unused this long: a worker
    # that joined after the coordinator's last look at the registry must not lose a peer it is using.
    stale_after_s = 60.0

    def release_stale_peers(self, live: set[str], idle_s: float | None = None) -> list[str]:
        """Let go of peers that are not in `live` and were not used for idle_s seconds; returns them."""
        idle_s = self.stale_after_s if idle_s is None else idle_s
        t = time.monotonic()
        stale = [p for p in self.peer_ids() if p not in live and t - self.last_used.get(p, 0.0) >= idle_s]
        for p in stale:
            self.drop_peer(p, departed=False)
            self.last_used.pop(p, None)
        return stale

    def _used(self, peer_id: str) -> None:
        self.last_used[peer_id] = time.monotonic()

    def peers_held(self) -> int:
        """Peers this engine keeps connections, mappings or descriptors for."""
        return 0

    def connect(self, peer_id: str, endpoint: bytes) -> None:
        """Set up what sends to this peer need, ahead of the first (engine.protocol.Introduce); a peer already
        set up is left as it is. ValueError or the backend's own error for a peer that cannot be reached; its
        first send then tries again and reports it."""
        if self.departed.get(peer_id) == endpoint:
            return  # it left: a late introduction must not set it up again
        self._open(peer_id, endpoint)

    def _open(self, peer_id: str, endpoint: bytes) -> None:
        pass  # backends with nothing to set up per peer

    def _departed(self, rid: str, peer_id: str, endpoint: bytes) -> bool:
        """Whether a send goes to a peer that left; if so, its failure is recorded."""
        if peer_id not in self.departed:
            return False
        if self.departed[peer_id] != endpoint:  # the same id, a new process: welcome back
            del self.departed[peer_id]
            return False
        self.done.append(self._record(SendResult(rid, False, f"{self.name}: peer {peer_id} left")))
        return True

    def _mark_departed(self, peer_id: str, endpoint: bytes) -> None:
        self.departed[peer_id] = endpoint
        while len(self.departed) > 1024:  # the oldest first
            del self.departed[next(iter(self.departed))]

    def close(self) -> None:
        pass

    def _check_pages(self, src_pages, dst_pages, remote_pages: int | None) -> None:
        """A one-sided write goes where the page lists say: lists that do not fit both pools (a bookkeeping error
        anywhere upstream) are refused, not written over another request's KV or past the receiver's pool.
        `remote_pages` None: the receiver checks its own (tcp)."""
        if len(src_pages) != len(dst_pages):
            raise ValueError("source and destination page lists differ in length")
        for pages, n, whose in ((src_pages, self.pool.num_pages, "source"), (dst_pages, remote_pages, "destination")):
            if n is not None and len(pages) and not (0 <= min(pages) and max(pages) < n):
                raise ValueError(f"a {whose} page is out of range (its pool has {n} pages)")

    def _record(self, result: SendResult) -> SendResult:
        if result.ok:
            self.stats.bytes += result.nbytes
            self.stats.seconds += result.seconds
            self.stats.count += 1
        else:
            self.stats.failures += 1
        return result


def now() -> float:
    return time.perf_counter()
