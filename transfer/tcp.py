"""TCP transfer over ZMQ, staged through host memory: works between any two machines.

The sender gathers the source pages of every layer into one contiguous host buffer and pushes it with a
msgpack header; the receiver checks the header against what it expects (request, pages, byte count, layout)
and only then copies the bytes into its pool. Data for a request it does not expect is dropped, so an
aborted request's pages can be reused at once.
"""

from __future__ import annotations

import logging

import msgspec
import torch
import zmq

from engine.protocol import KVLayout
from transfer.base import SendResult, TransferEngine, now

logger = logging.getLogger(__name__)


class _Header(msgspec.Struct):
    rid: str
    sender: str
    layout: KVLayout
    dst_pages: list[int]
    nbytes: int
    notify: bytes


class TcpTransfer(TransferEngine):
    name = "tcp"
    one_sided = False

    def __init__(self, pool, worker_id: str, host: str, ctx: zmq.Context | None = None):
        super().__init__(pool, worker_id, host)
        self.ctx = ctx or zmq.Context.instance()
        self.rx = self.ctx.socket(zmq.PULL)
        self.rx.setsockopt(zmq.LINGER, 0)
        self.rx.setsockopt(zmq.MAXMSGSIZE, -1)
        self.rx.bind(f"tcp://{host}:*")
        self.addr = self.rx.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peers: dict[str, tuple[bytes, zmq.Socket]] = {}  # peer id -> (its endpoint, our socket to it)
        self.expected: dict[str, list[int]] = {}
        self.done: list[SendResult] = []
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(_Header)

    def endpoint(self) -> bytes:
        return self.addr.encode()

    def sockets(self):
        return [self.rx]

    def _open(self, peer_id: str, endpoint: bytes) -> None:
        self._peer(peer_id, endpoint)

    def _peer(self, peer_id: str, endpoint: bytes) -> zmq.Socket:
        entry = self.peers.get(peer_id)
        if entry is not None and entry[0] != endpoint:  # the peer restarted under the same id
            self.drop_peer(peer_id)
            entry = None
        if entry is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
            sock.connect(endpoint.decode())
            entry = self.peers[peer_id] = (endpoint, sock)
        self._used(peer_id)
        return entry[1]

    def send(self, rid, peer_id, peer_endpoint, src_pages, dst_pages, notify):
        t0 = now()
        if self._departed(rid, peer_id, peer_endpoint):
            return
        try:
            self._check_pages(src_pages, dst_pages, None)
        except ValueError as e:
            self.done.append(self._record(SendResult(rid, False, f"tcp: {e}")))
            return
        data = self.pool.data
        # [layers, n, 2, page, heads, dim] gathered on the device, then one copy to host memory.
        idx = torch.tensor(src_pages, dtype=torch.long, device=data.device)
        staged = data.index_select(1, idx).contiguous().cpu()
        payload = staged.view(torch.uint8).numpy()
        header = _Header(rid, self.worker_id, self.layout, list(dst_pages), payload.nbytes, notify)
        try:
            self._peer(peer_id, peer_endpoint).send_multipart([self._enc.encode(header), payload],
                                                              flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.done.append(self._record(SendResult(rid, False, f"peer {peer_id} is not taking data")))
            return
        self.done.append(self._record(SendResult(rid, True, nbytes=payload.nbytes, seconds=now() - t0)))

    def poll_sent(self):
        out, self.done = self.done, []
        return out

    def expect(self, rid, dst_pages):
        self.expected[rid] = list(dst_pages)

    def forget(self, rid):
        self.expected.pop(rid, None)

    def poll_received(self):
        out = []
        while True:
            try:
                frames = self.rx.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            got = self._land(frames)
            if got is not None:
                out.append(got)

    def _land(self, frames):
        if len(frames) != 2:
            logger.warning("tcp transfer: dropped a message of %d frames", len(frames))
            return None
        try:
            h = self._dec.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("tcp transfer: dropped a malformed header: %s", e)
            return None
        want = self.expected.get(h.rid)
        data = self.pool.data
        page_bytes = self.pool.page_bytes
        if want is None or want != h.dst_pages:
            logger.info("tcp transfer: dropped pages of %s (not expected here)", h.rid)
            return None
        if h.layout != self.layout or h.nbytes != len(h.dst_pages) * page_bytes or len(frames[1].buffer) != h.nbytes:
            logger.warning("tcp transfer: %s from %s does not fit this pool (layout or size)", h.rid, h.sender)
            return None
        del self.expected[h.rid]
        L = data.shape[0]
        src = torch.frombuffer(frames[1].buffer, dtype=torch.uint8).view(data.dtype)
        src = src.view(L, len(h.dst_pages), *data.shape[2:])
        idx = torch.tensor(h.dst_pages, dtype=torch.long, device=data.device)
        data.index_copy_(1, idx, src.to(data.device))
        return h.rid, h.notify

    def peers_held(self):
        return len(self.peers)

    def drop_peer(self, peer_id, departed=True):
        entry = self.peers.pop(peer_id, None)
        if entry is not None:
            entry[1].close(0)
            if departed:
                self._mark_departed(peer_id, entry[0])

    def peer_ids(self):
        return list(self.peers)

    def close(self):
        for _, sock in self.peers.values():
            sock.close(0)
        self.rx.close(0)
