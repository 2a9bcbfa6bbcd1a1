"""Outgoing control messages: one PUSH socket per destination address, never blocking the sender.

A message the peer has no room for (its queue and ours full: a coordinator behind the decode workers' token
rate, or stalled) waits in a backlog and goes before anything newer, rather than being dropped: a lost
TokenBatch would leave a hole in a client's text that nothing downstream could see. Blocking instead would
stall every other peer's requests behind the slow one. The backlog is bounded: past `max_backlog` messages,
or once the peer has taken nothing for `idle_close_s`, it is taken for gone and what is addressed to it is
dropped, said once.

A socket that has taken nothing for `idle_close_s` is closed (the next message opens another): over weeks of
workers coming and going, sockets to departed peers would otherwise pile up, each retrying its connection
forever, with whatever was queued for them.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from engine.protocol import encode

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, ctx: zmq.Context, hwm: int = 10000, max_backlog: int = 100_000, idle_close_s: float = 600.0):
        self.ctx = ctx
        self.hwm = hwm
        self.max_backlog = max_backlog
        self.idle_close_s = idle_close_s
        self._socks: dict[str, zmq.Socket] = {}
        self._took: dict[str, float] = {}  # when each socket last took a message (or was opened)
        self._backlog: dict[str, deque[bytes]] = {}
        self._dropped: dict[str, int] = {}
        self._warned: dict[str, float] = {}  # when each peer was last said to lag (at most every 30 s)
        self._next_sweep = time.monotonic() + min(idle_close_s, 30.0)

    def send(self, addr: str, msg) -> bool:
        """Send `msg` to `addr`, after whatever waits for it; False (and a warning) when it had to be dropped."""
        sock = self._socks.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.connect(addr)
            self._socks[addr] = sock
            self._took[addr] = time.monotonic()
        data = encode(msg)
        waiting = self._backlog.get(addr)
        if waiting is None:
            try:
                sock.send(data, flags=zmq.NOBLOCK)
                self._took[addr] = time.monotonic()
                return True
            except zmq.Again:
                now = time.monotonic()
                if now - self._warned.get(addr, -60.0) >= 30.0:
                    self._warned[addr] = now
                    logger.warning("%s is not keeping up: messages to it wait here", addr)
                self._backlog[addr] = waiting = deque()
        if len(waiting) >= self.max_backlog:
            self._drop(addr, 1)
            return False
        waiting.append(data)
        self._flush(addr)
        return True

    def flush(self) -> None:
        """Send what waits, as far as the peers take it; close what is idle (called from the owner's loop)."""
        for addr in list(self._backlog):
            self._flush(addr)
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(self.idle_close_s, 30.0)
        for addr, took in list(self._took.items()):
            if now - took >= self.idle_close_s:
                waiting = self._backlog.pop(addr, None)
                if waiting:
                    self._drop(addr, len(waiting))
                    logger.error("%s took no message for %.0f s: it is taken for gone", addr, now - took)
                self._dropped.pop(addr, None)
                self._socks.pop(addr).close(0)
                del self._took[addr]

    def backlog(self) -> int:
        return sum(len(q) for q in self._backlog.values())

    def peers(self) -> int:
        """Sockets open now."""
        return len(self._socks)

    def _drop(self, addr: str, n: int) -> None:
        if addr not in self._dropped:
            logger.error("dropping messages to %s, %d waiting: it takes none", addr, len(self._backlog.get(addr, ())))
        self._dropped[addr] = self._dropped.get(addr, 0) + n

    def _flush(self, addr: str) -> None:
        waiting, sock = self._backlog[addr], self._socks[addr]
        try:
            while waiting:
                sock.send(waiting[0], flags=zmq.NOBLOCK)
                waiting.popleft()
                self._took[addr] = time.monotonic()
        except zmq.Again:
            return
        del self._backlog[addr]
        dropped = self._dropped.pop(addr, 0)
        if dropped:
            logger.warning("%s takes messages again; %d were dropped", addr, dropped)

    def close(self, linger_s: float = 0.0) -> None:
        """Close every socket; what they hold still goes out for up to `linger_s` (as the context is
        terminated), what waits in a backlog only as far as the peers take it now."""
        for addr in list(self._backlog):
            self._flush(addr)
        for sock in self._socks.values():
            sock.close(int(linger_s * 1000))
        self._socks.clear()
        self._backlog.clear()
