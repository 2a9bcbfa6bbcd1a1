"""Outgoing control messages: one PUSH socket per destination address, never blocking the sender.

A message the peer has no room for (its queue and ours full: a coordinator behind the decode workers' token
rate, or stalled) waits in a backlog and goes before anything newer, rather than being dropped: a lost
TokenBatch would leave a hole in a client's text that nothing downstream could see. Blocking instead would
stall every other peer's requests behind the slow one. The backlog is bounded: a peer that takes nothing
while `max_backlog` messages pile up is taken for gone, and what is addressed to it is dropped, said once.

A socket unused for `idle_close_s` is closed (the next message opens another): over weeks of workers coming
and going, sockets to departed peers would otherwise pile up, each retrying its connection forever.
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
        self._used: dict[str, float] = {}  # when each socket last took a message
        self._next_sweep = time.monotonic() + idle_close_s
        self._backlog: dict[str, deque[bytes]] = {}
        self._dropped: dict[str, int] = {}
        self._warned: dict[str, float] = {}  # when each peer was last said to lag (at most every 30 s)

    def send(self, addr: str, msg) -> bool:
        """Send `msg` to `addr`, after whatever waits for it; False (and a warning) when it had to be dropped."""
        sock = self._socks.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.connect(addr)
            self._socks[addr] = sock
        self._used[addr] = time.monotonic()
        data = encode(msg)
        waiting = self._backlog.get(addr)
        if waiting is None:
            try:
                sock.send(data, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                now = time.monotonic()
                if now - self._warned.get(addr, -60.0) >= 30.0:
                    self._warned[addr] = now
                    logger.warning("%s is not keeping up: messages to it wait here", addr)
                self._backlog[addr] = waiting = deque()
        if len(waiting) >= self.max_backlog:
            if addr not in self._dropped:
                logger.error("dropping messages to %s: it took none of the last %d", addr, len(waiting))
            self._dropped[addr] = self._dropped.get(addr, 0) + 1
            return False
        waiting.append(data)
        self._flush(addr)
        return True

    def flush(self) -> None:
        """Send what waits, as far as the peers take it, and close idle sockets (called from the owner's loop)."""
        for addr in list(self._backlog):
            self._flush(addr)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + min(self.idle_close_s, 30.0)
            for addr, used in list(self._used.items()):
                if now - used >= self.idle_close_s and addr not in self._backlog:
                    self._socks.pop(addr).close(0)
                    del self._used[addr]

    def peers(self) -> int:
        """Sockets open now."""
        return len(self._socks)

    def backlog(self) -> int:
        return sum(len(q) for q in self._backlog.values())

    def _flush(self, addr: str) -> None:
        waiting, sock = self._backlog[addr], self._socks[addr]
        try:
            while waiting:
                sock.send(waiting[0], flags=zmq.NOBLOCK)
                waiting.popleft()
        except zmq.Again:
            return
        del self._backlog[addr]
        dropped = self._dropped.pop(addr, 0)
        if dropped:
            logger.warning("%s takes messages again; %d were dropped", addr, dropped)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
        self._backlog.clear()
