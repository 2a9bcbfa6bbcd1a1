"""Which coordinators a worker still works for.

Each coordinator renews a Lease with every worker once a second (coordinator/dispatcher.py). A worker whose
coordinator stops renewing (killed, its host gone, a network cut between them) ends the requests it placed:
nobody reads their tokens, and left alone they would decode to their max_tokens, holding KV pages and batch
slots that live coordinators' requests wait for.

Only coordinators that have sent a Lease are watched: a request's Lease always goes before it on the same
socket, so one placed by a coordinator that never leases (a test playing the coordinator, an older one)
is left alone rather than ended at once. The check runs after the worker has drained its control socket,
so a worker that was itself busy (a long step) reads the renewals queued meanwhile before it judges.

A coordinator that stops in order sends a Lease of no time: its requests end at once, and nobody waits out its
lease or warns that it was lost.
"""

from __future__ import annotations

import time

from engine.protocol import Lease


class Leases:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._until: dict[str, float] = {}  # reply_to -> when its lease runs out
        self._ttl: dict[str, float] = {}

    def renew(self, lease: Lease) -> None:
        self._until[lease.reply_to] = self.clock() + lease.ttl_s
        self._ttl[lease.reply_to] = lease.ttl_s

    def release(self, reply_to: str) -> None:
        """The coordinator stopped in order (its Lease of no time): no longer watched, until it leases again."""
        self._until.pop(reply_to, None)
        self._ttl.pop(reply_to, None)

    def lapsed(self) -> list[tuple[str, float]]:
        """(reply_to, ttl_s) of each coordinator whose lease ran out since the last call; each is forgotten,
        and watched again from its next Lease (a coordinator that was only stalled, or restarted on the same
        address)."""
        now = self.clock()
        out = [(addr, self._ttl.pop(addr)) for addr, until in self._until.items() if until <= now]
        for addr, _ in out:
            del self._until[addr]
        return out

    def __len__(self) -> int:
        return len(self._until)
