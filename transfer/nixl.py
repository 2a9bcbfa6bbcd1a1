"""NIXL transfer (UCX backend): the sender writes pages straight into the receiver's registered pool.

Each pool is registered once. Descriptors cut it into (layer, page) blocks, so a request's transfer is a
list of block indices on both sides; NIXL delivers the notification (the KVReady message) after the data.
Host memory on a CPU machine, device memory on a GPU. Writes are one-sided: see transfer/base.py.
"""

from __future__ import annotations

import logging
import os
import uuid

import msgspec
import numpy as np

from engine.outage import OutageLog
from transfer.base import SendResult, TransferEngine, now

logger = logging.getLogger(__name__)


def _nixl_api():
    # NIXL logs every agent's start at INFO on stdout; keep stdout for our own output unless asked.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu13._api import nixl_agent, nixl_agent_config
        except ImportError:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def nixl_available() -> bool:
    try:
        _nixl_api()
        return True
    except ImportError:
        return False


class _Endpoint(msgspec.Struct):
    agent_meta: bytes
    base: int
    num_layers: int
    num_pages: int
    block_bytes: int  # one page of one layer
    mem: str
    device_id: int
    order: str = "NHD"


class NixlTransfer(TransferEngine):
    name = "nixl"
    one_sided = True

    def __init__(self, pool, worker_id: str, host: str):
        super().__init__(pool, worker_id, host)
        nixl_agent, nixl_agent_config = _nixl_api()
        # Agent names must be unique per process lifetime: a restarted worker is a new agent to its peers.
        self.agent_name = f"{worker_id}-{uuid.uuid4().hex[:8]}"
        # No progress thread: it busy-polls a core; the worker loop drives progress when it polls.
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        data = pool.data
        self.mem = "VRAM" if data.is_cuda else "DRAM"
        self.device_id = data.device.index or 0 if data.is_cuda else 0
        self.reg = self.agent.register_memory(data)
        self.block_bytes = pool.page_bytes // pool.num_layers
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._blocks(data.data_ptr(), pool.num_layers,
                                                pool.num_pages, self.block_bytes, self.device_id), self.mem)
        # peer -> (agent name, dlist, endpoint, the endpoint's bytes)
        self.remotes: dict[str, tuple[str, object, _Endpoint, bytes]] = {}
        self.pending: dict[str, tuple[object, float, int, str]] = {}  # rid -> (handle, start, bytes, peer)
        self.leaving: set[str] = set()  # peers dropped while transfers to them were in flight
        self.done: list[SendResult] = []
        self.expected: set[str] = set()
        self._notif_outage = OutageLog(logger, "nixl: reading notifications")

    @staticmethod
    def _blocks(base: int, layers: int, pages: int, block: int, dev: int) -> np.ndarray:
        # Block (layer, page) at base + (layer * pages + page) * block: the pool is [layers, pages, ...].
        addrs = base + np.arange(layers * pages, dtype=np.int64) * block
        return np.stack([addrs, np.full_like(addrs, block), np.full_like(addrs, dev)], axis=1)

    def endpoint(self) -> bytes:
        p = self.pool
        return msgspec.msgpack.encode(_Endpoint(self.agent.get_agent_metadata(), p.data.data_ptr(), p.num_layers,
                                                p.num_pages, self.block_bytes, self.mem, self.device_id, p.layout))

    def _open(self, peer_id: str, endpoint: bytes) -> None:
        name = self._remote(peer_id, endpoint)[0]
        # UCX otherwise wires the endpoints up in the first transfer, and the receiver's side of that showed
        # in the first request's TTFT too.
        self.agent.make_connection(name)

    def _remote(self, peer_id: str, endpoint: bytes):
        if peer_id in self.remotes and self.remotes[peer_id][3] != endpoint:
            self.drop_peer(peer_id)  # restarted under the same id: what still goes to the old process fails
        if peer_id not in self.remotes:
            ep = msgspec.msgpack.decode(endpoint, type=_Endpoint)
            if ep.block_bytes != self.block_bytes or ep.num_layers != self.pool.num_layers or \
                    ep.order != self.pool.layout:
                raise ValueError(f"peer {peer_id} has a different KV layout")
            name = self.agent.add_remote_agent(ep.agent_meta)
            if isinstance(name, bytes):
                name = name.decode()
            dl = self.agent.prep_xfer_dlist(name, self._blocks(ep.base, ep.num_layers, ep.num_pages, ep.block_bytes,
                                                               ep.device_id), ep.mem)
            self.remotes[peer_id] = (name, dl, ep, endpoint)
        self._used(peer_id)
        return self.remotes[peer_id]

    def send(self, rid, peer_id, peer_endpoint, src_pages, dst_pages, notify):
        t0 = now()
        if self._departed(rid, peer_id, peer_endpoint):
            return
        try:
            _, remote_dl, ep, _ = self._remote(peer_id, peer_endpoint)
            self._check_pages(src_pages, dst_pages, ep.num_pages)
            layers = np.arange(self.pool.num_layers, dtype=np.int64)[:, None]
            local_idx = (layers * self.pool.num_pages + np.asarray(src_pages, dtype=np.int64)[None, :]).ravel()
            remote_idx = (layers * ep.num_pages + np.asarray(dst_pages, dtype=np.int64)[None, :]).ravel()
            handle = self.agent.make_prepped_xfer("WRITE", self.local, local_idx.astype(np.int32).tolist(),
                                                  remote_dl, remote_idx.astype(np.int32).tolist(), notify)
            state = self.agent.transfer(handle)
        except Exception as e:  # NIXL raises its own error types
            self.done.append(self._record(SendResult(rid, False, f"nixl: {e}")))
            return
        if state == "ERR":
            self.done.append(self._record(SendResult(rid, False, "nixl: transfer failed to post")))
            return
        self.pending[rid] = (handle, t0, len(local_idx) * self.block_bytes, peer_id)

    def poll_sent(self):
        for rid, (handle, t0, nbytes, _) in list(self.pending.items()):
            error = "nixl: transfer failed"
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as e:  # a receiver killed mid-write: NIXL raises (REMOTE_DISCONNECT), not ERR
                state, error = "ERR", f"nixl: {e}"
            if state == "PROC":
                continue
            self._end(rid, state == "DONE", error, nbytes, t0)
        for peer in [p for p in self.leaving if not self._busy(p)]:
            self.leaving.discard(peer)
            self._release(peer)
        out, self.done = self.done, []
        return out

    def _end(self, rid: str, ok: bool, error: str, nbytes: int, t0: float) -> None:
        handle = self.pending.pop(rid)[0]
        try:
            self.agent.release_xfer_handle(handle)  # of one still in flight: cancels it
        except Exception as e:
            logger.warning("nixl: releasing the transfer of %s: %s", rid, e)
        self.done.append(self._record(SendResult(rid, ok, "" if ok else error, nbytes, now() - t0)))

    def expect(self, rid, dst_pages):
        self.expected.add(rid)

    def forget(self, rid):
        self.expected.discard(rid)

    def poll_received(self):
        out = []
        try:
            notifs = self.agent.get_new_notifs()
        except Exception as e:  # as the sender's status check can (a peer killed mid-write): try again next poll
            self._notif_outage.failed(e)
            return []
        self._notif_outage.ok()
        for _agent, msgs in notifs.items():
            for m in msgs:
                out.append(m)
        from engine.protocol import decode

        got = []
        for m in out:
            msg = decode(bytes(m))
            if msg is None or not hasattr(msg, "rid"):
                continue
            self.expected.discard(msg.rid)
            got.append((msg.rid, bytes(m)))
        return got

    def _busy(self, peer_id: str) -> bool:
        return any(p[3] == peer_id for p in self.pending.values())

    def peers_held(self):
        return len(self.remotes)

    def peer_ids(self):
        return list(self.remotes)

    def drop_peer(self, peer_id, departed=True):
        if peer_id in self.remotes and departed:
            self._mark_departed(peer_id, self.remotes[peer_id][3])
            # Writes to a receiver that died may never end: UCX neither finishes nor fails one whose connection
            # went quiet, and each would hold its request's source pages for good. They are cancelled.
            for rid, (_, t0, nbytes, peer) in list(self.pending.items()):
                if peer == peer_id:
                    self._end(rid, False, f"nixl: peer {peer_id} left during the transfer", nbytes, t0)
        # A transfer in flight still uses the peer's descriptors: release them once it has ended (poll_sent).
        if self._busy(peer_id):
            self.leaving.add(peer_id)
        else:
            self._release(peer_id)

    def _release(self, peer_id: str) -> None:
        entry = self.remotes.pop(peer_id, None)
        if entry is not None:
            name, dl = entry[0], entry[1]
            try:
                self.agent.release_dlist_handle(dl)
                self.agent.remove_remote_agent(name)
            except Exception as e:
                logger.warning("nixl: releasing peer %s: %s", peer_id, e)

    def close(self):
        for peer in list(self.remotes):
            self._release(peer)
