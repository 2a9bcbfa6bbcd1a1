"""CUDA IPC transfer: within one machine, the prefill worker writes straight into the decode worker's pool.

The decode worker exports its pool's storage once (a CUDA IPC handle in its endpoint); the prefill worker
maps it on first use and copies a request's pages for all layers with one page-copy kernel launch. When the
copy has finished on the GPU (an event), the notification goes over ZMQ to the decode worker. Writes are
one-sided, as with NIXL (see transfer/base.py on aborts).

The notification is sent by a thread of its own that sleeps on each copy's event. The worker's loop only
notices a finished copy between engine steps, and a prefill step can take a hundred milliseconds: the decode
worker, and the request's first token, would wait for it.

A send is one CUDA graph replay: per peer and per page count rounded up to a power of two, a graph copies the
page lists from a fixed pinned buffer to the device and runs the page-copy kernel (padding pairs are skipped).
Launching the two from Python costs more host time than the copy itself takes on the GPU for a few thousand
tokens, and that host time is TTFT.
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import struct
import threading

import msgspec
import torch
import zmq

from kernels.page_copy import copy_pages
from transfer.base import SendResult, TransferEngine, now

logger = logging.getLogger(__name__)


def machine_id() -> str:
    """One id per booted machine: processes that share it can share GPU memory through CUDA IPC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class _Endpoint(msgspec.Struct):
    machine: str
    notify_addr: str
    handle: list  # torch's description of the shared storage (device, handle, size, offset, refcount, event)
    shape: list[int]
    dtype: str
    order: str = "NHD"
    gpu: str = ""  # the pool's GPU (its UUID): the page-copy kernel writes the peer's pool from its own GPU


def gpu_id(device: torch.device) -> str:
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return ""


def same_gpu(a: bytes, b: bytes) -> bool:
    """Whether two endpoints' pools are on one GPU of one machine (an endpoint that does not say which GPU
    counts as the other's)."""
    try:
        x, y = msgspec.msgpack.decode(a, type=_Endpoint), msgspec.msgpack.decode(b, type=_Endpoint)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return x.machine == y.machine and (x.gpu == y.gpu or not x.gpu or not y.gpu)


@functools.lru_cache(maxsize=64)
def _int32s(n: int) -> struct.Struct:
    return struct.Struct(f"={n}i")


class PageLists:
    """A fixed [2, bucket] int32 buffer of (source, destination) page pairs, padded with -1 (pairs the
    page-copy kernel skips). The host's time to fill it is time the copy waits for: struct writes a list of
    ints into it in half the time numpy takes to convert one."""

    def __init__(self, bucket: int, pin_memory: bool = True):
        self.bucket = bucket
        self.host = torch.full((2, bucket), -1, dtype=torch.int32, pin_memory=pin_memory)
        self.lists = self.host.numpy()
        self.raw = memoryview(self.lists).cast("B")
        self.filled = 0  # entries of each list that may hold pairs; those past it are padding

    def write(self, src_pages, dst_pages, src_limit: int, dst_limit: int) -> None:
        """Fill the buffer with the pairs, refusing any page outside [0, limit) of its pool."""
        n = len(src_pages)
        if len(dst_pages) != n or n > self.bucket:
            raise ValueError(f"page lists of {n} and {len(dst_pages)} pages for a buffer of {self.bucket}")
        try:
            fmt = _int32s(n)
            fmt.pack_into(self.raw, 0, *src_pages)
            fmt.pack_into(self.raw, 4 * self.bucket, *dst_pages)
        except struct.error as e:
            self.filled = self.bucket  # partly written: clear it all next time
            raise ValueError(f"page lists: {e}") from None
        try:
            check_range(self.lists[:, :n], src_limit, dst_limit)
        except ValueError:
            self.filled = max(self.filled, n)  # the refused pairs are cleared next time
            raise
        if n < self.filled:
            self.lists[:, n:self.filled] = -1
        self.filled = n


def check_range(pairs, src_limit: int, dst_limit: int) -> None:
    """Refuse [2, n] page pairs that do not fit both pools: a one-sided write would land on another request's
    KV or past the receiver's pool. Checked on the int32 buffer the copy reads, after it is filled: numpy's
    min and max take a few microseconds where Python's take tens over a long list, and the copy waits."""
    if pairs.shape[1] == 0:
        return
    for row, limit, whose in ((0, src_limit, "source"), (1, dst_limit, "destination")):
        if pairs[row].min() < 0 or pairs[row].max() >= limit:
            raise ValueError(f"a {whose} page is out of range (its pool has {limit} pages)")


class _CopyGraph:
    """Send `bucket` page pairs (or fewer) from our pool into one peer's mapped pool: one graph replay."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, bucket: int):
        self.pairs = PageLists(bucket)
        self.host = self.pairs.host
        self.src_pages = src.shape[1]
        self.dev = torch.full((2, bucket), -1, dtype=torch.int32, device=src.device)
        self.last: torch.cuda.Event | None = None
        stream = torch.cuda.Stream(src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            copy_pages(src, dst, self.dev[0], self.dev[1])  # compile outside the capture (all pairs padding)
        torch.cuda.current_stream(src.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.dev.copy_(self.host, non_blocking=True)
            copy_pages(src, dst, self.dev[0], self.dev[1])

    def send(self, src_pages, dst_pages, dst_limit: int) -> torch.cuda.Event:
        if self.last is not None:
            self.last.synchronize()  # the previous replay has read the pinned lists (long since, as a rule)
        self.pairs.write(src_pages, dst_pages, self.src_pages, dst_limit)
        self.graph.replay()
        self.last = torch.cuda.Event(blocking=True)
        self.last.record()
        return self.last


class _Notifier(threading.Thread):
    """Waits for each copy's event in order and then sends its notification. It owns the notification sockets
    (a ZMQ socket belongs to one thread); the worker's thread hands it jobs and reads back the results."""

    def __init__(self, ctx: zmq.Context, device: int | None):
        super().__init__(name="cuda-ipc-notify", daemon=True)
        self.ctx = ctx
        self.device = device  # the CUDA device its events belong to
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()  # (rid, error or None)

    def notify(self, rid: str, event: torch.cuda.Event, addr: str, note: bytes) -> None:
        self.jobs.put((rid, event, addr, note))

    def forget(self, addr: str) -> None:
        """Close the socket to a peer that left, after every notification queued before."""
        self.jobs.put((None, None, addr, None))

    def stop(self) -> None:
        self.jobs.put(None)
        self.join(timeout=10)

    def run(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)
        socks: dict[str, zmq.Socket] = {}
        while (job := self.jobs.get()) is not None:
            rid, event, addr, note = job
            if rid is None:
                sock = socks.pop(addr, None)
                if sock is not None:
                    sock.close(0)
                continue
            error = None
            try:
                event.synchronize()  # a blocking event: the thread sleeps, the GIL is released
                if addr not in socks:
                    sock = socks[addr] = self.ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(addr)
                socks[addr].send_multipart([rid.encode(), note], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # not taking notices (Again), or gone
                error = f"cuda_ipc: notice not sent: {e}"
            except Exception as e:  # the copy itself failed on the device: report it, keep serving the rest
                error = f"cuda_ipc: {e}"
            self.results.put((rid, error))
        for sock in socks.values():
            sock.close(0)


class CudaIpcTransfer(TransferEngine):
    name = "cuda_ipc"
    one_sided = True
    max_graph_pages = 8192  # the largest send made by a graph (128k tokens of 16-token pages)

    def __init__(self, pool, worker_id: str, host: str, ctx: zmq.Context | None = None):
        super().__init__(pool, worker_id, host)
        if not pool.data.is_cuda:
            raise ValueError("cuda_ipc needs the KV pool on a GPU")
        self.ctx = ctx or zmq.Context.instance()
        self.rx = self.ctx.socket(zmq.PULL)
        self.rx.setsockopt(zmq.LINGER, 0)
        self.rx.bind(f"tcp://{host}:*")
        self.addr = self.rx.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peers: dict[str, tuple[torch.Tensor, str, bytes]] = {}  # mapped pool, notice address, endpoint
        self.graphs: dict[tuple[str, int], _CopyGraph] = {}
        # Sends whose notification the notifier has not reported yet: rid -> (event, peer, start, bytes).
        self.inflight: dict[str, tuple[torch.cuda.Event, str, float, int]] = {}
        self.done: list[SendResult] = []
        self.notifier: _Notifier | None = None

    def endpoint(self) -> bytes:
        data = self.pool.data
        handle = list(data.untyped_storage()._share_cuda_())
        return msgspec.msgpack.encode(_Endpoint(machine_id(), self.addr, handle, list(data.shape),
                                                str(data.dtype).removeprefix("torch."), self.pool.layout,
                                                gpu_id(data.device)))

    def sockets(self):
        return [self.rx]

    def _open(self, peer_id: str, endpoint: bytes) -> None:
        self._peer(peer_id, endpoint)

    def _peer(self, peer_id: str, endpoint: bytes):
        if peer_id in self.peers and self.peers[peer_id][2] != endpoint:  # the peer restarted under the same id
            self.drop_peer(peer_id)
        if peer_id not in self.peers:
            ep = msgspec.msgpack.decode(endpoint, type=_Endpoint)
            if ep.machine != machine_id():
                raise ValueError(f"peer {peer_id} is on another machine")
            if ep.dtype != self.layout.dtype or ep.order != self.pool.layout or ep.shape[0] != self.pool.num_layers or \
                    tuple(ep.shape[2:]) != tuple(self.pool.data.shape[2:]):
                raise ValueError(f"peer {peer_id} has a different KV layout")
            if ep.gpu and ep.gpu != gpu_id(self.pool.device):
                # Writing another GPU's memory from this one needs peer access, which nothing here sets up.
                raise ValueError(f"peer {peer_id}'s pool is on another GPU")
            storage = torch.UntypedStorage._new_shared_cuda(*ep.handle)
            remote = torch.empty(0, dtype=self.pool.dtype, device=self.pool.device)
            remote.set_(storage, 0, tuple(ep.shape))
            self.peers[peer_id] = (remote, ep.notify_addr, endpoint)
        self._used(peer_id)
        return self.peers[peer_id][:2]

    def send(self, rid, peer_id, peer_endpoint, src_pages, dst_pages, notify):
        t0 = now()
        if self._departed(rid, peer_id, peer_endpoint):
            return
        try:
            remote, addr = self._peer(peer_id, peer_endpoint)
            n = len(src_pages)
            if len(dst_pages) != n:
                raise ValueError("source and destination page lists differ in length")
            if rid in self.inflight:
                raise ValueError(f"a send of {rid} is already in flight")
            event = self._copy(peer_id, remote, src_pages, dst_pages)
        except (ValueError, RuntimeError) as e:
            self.done.append(self._record(SendResult(rid, False, f"cuda_ipc: {e}")))
            return
        if self.notifier is None:
            device = self.pool.device
            self.notifier = _Notifier(self.ctx, device.index if device.index is not None else torch.cuda.current_device())
            self.notifier.start()
        self.inflight[rid] = (event, peer_id, t0, n * self.pool.page_bytes)
        self.notifier.notify(rid, event, addr, notify)

    def _copy(self, peer_id: str, remote: torch.Tensor, src_pages, dst_pages) -> torch.cuda.Event:
        n = len(src_pages)
        bucket = max(16, 1 << max(0, n - 1).bit_length())
        if n and bucket <= self.max_graph_pages:
            key = (peer_id, bucket)
            if key not in self.graphs:
                self.graphs[key] = _CopyGraph(self.pool.data, remote, bucket)
            return self.graphs[key].send(src_pages, dst_pages, remote.shape[1])
        # Beyond the largest graph (or nothing to send) two launches cost little next to the copy itself.
        # The page lists go in one asynchronous copy from pinned memory (torch's caching host allocator keeps
        # the buffer until the copy has run), so the host does not wait for the device here.
        host = torch.empty(2 * n, dtype=torch.int32, pin_memory=True)
        try:
            host.numpy()[:n] = src_pages
            host.numpy()[n:] = dst_pages
        except (OverflowError, TypeError) as e:
            raise ValueError(f"page lists: {e}") from None
        check_range(host.numpy().reshape(2, n), self.pool.num_pages, remote.shape[1])
        pages = host.to(self.pool.device, non_blocking=True)
        copy_pages(self.pool.data, remote, pages[:n], pages[n:])
        event = torch.cuda.Event(blocking=True)
        event.record()
        return event

    def poll_sent(self):
        while self.notifier is not None:
            try:
                rid, error = self.notifier.results.get_nowait()
            except queue.Empty:
                break
            entry = self.inflight.pop(rid, None)
            if entry is None:  # reported already (its peer left first)
                continue
            _, _, t0, nbytes = entry
            self.done.append(self._record(SendResult(rid, error is None, error or "", nbytes, now() - t0)))
        out, self.done = self.done, []
        return out

    def expect(self, rid, dst_pages):
        pass  # one-sided: the decode role keeps the pages of requests it gave up on (transfer/base.py)

    def forget(self, rid):
        pass

    def poll_received(self):
        out = []
        while True:
            try:
                frames = self.rx.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) == 2:
                out.append((frames[0].decode(errors="replace"), frames[1]))

    def peers_held(self):
        return len(self.peers)

    def peer_ids(self):
        return list(self.peers)

    def drop_peer(self, peer_id, departed=True):
        """Unmap the peer's pool, which frees it on the GPU if its process is gone. Copies into it that may
        still run are waited for first: unmapping under a running kernel would fault the whole context."""
        entry = self.peers.pop(peer_id, None)
        graphs = [self.graphs.pop(k) for k in [k for k in self.graphs if k[0] == peer_id]]
        if entry is None:
            return
        for g in graphs:
            if g.last is not None:
                g.last.synchronize()
        for rid, (event, peer, _, _) in list(self.inflight.items()):
            if peer == peer_id:
                event.synchronize()
                del self.inflight[rid]
                self.done.append(self._record(SendResult(rid, False, f"cuda_ipc: peer {peer_id} left")))
        if self.notifier is not None:
            self.notifier.forget(entry[1])
        if departed:
            self._mark_departed(peer_id, entry[2])

    def close(self):
        for peer in list(self.peers):
            self.drop_peer(peer)
        if self.notifier is not None:
            self.notifier.stop()
        self.rx.close(0)
