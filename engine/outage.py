"""Logging a dependency that is down (the Redis registry, for the coordinator and every worker) without a line
for every retry: those come every 0.25-0.5 s, and a registry down for a minute buried each log in hundreds of
identical warnings. The first failure is logged, then a reminder every `every_s` with the count, then the
recovery."""

from __future__ import annotations

import logging
import time


class OutageLog:
    def __init__(self, logger: logging.Logger, what: str, every_s: float = 30.0, clock=time.monotonic):
        self.logger, self.what, self.every_s, self.clock = logger, what, every_s, clock
        self.failures = 0
        self.since = 0.0
        self._next = 0.0

    def failed(self, error: BaseException) -> None:
        now = self.clock()
        if self.failures == 0:
            self.since, self._next = now, now + self.every_s
            self.logger.warning("%s failed: %s", self.what, error)
        elif now >= self._next:
            self._next = now + self.every_s
            self.logger.warning("%s still failing after %.0f s (%d attempts): %s", self.what, now - self.since,
                                self.failures + 1, error)
        self.failures += 1

    def ok(self) -> None:
        if self.failures:
            self.logger.warning("%s works again after %.0f s (%d failed attempts)", self.what,
                                self.clock() - self.since, self.failures)
            self.failures = 0
