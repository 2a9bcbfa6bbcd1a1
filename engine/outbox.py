"""Outgoing control messages: one PUSH socket per destination address, never blocking the sender."""

from __future__ import annotations

import logging

import zmq

from engine.protocol import encode

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, ctx: zmq.Context, hwm: int = 10000):
        self.ctx = ctx
        self.hwm = hwm
        self._socks: dict[str, zmq.Socket] = {}

    def send(self, addr: str, msg) -> bool:
        """Queue `msg` for `addr`; False (and a warning) when that peer's queue is full."""
        sock = self._socks.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.connect(addr)
            self._socks[addr] = sock
        try:
            sock.send(encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("dropped a %s to %s: its queue is full", type(msg).__name__, addr)
            return False

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
