"""Transfer engines move pages bit-exactly, refuse what does not fit, and honour forget()."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from played import errors, finished

from engine.protocol import Abort, KVReady, decode, encode
from kvstore import KVPool
from transfer import agree, available_backends, create_transfer, join_rank_endpoints, rank_endpoints

BACKENDS = ["tcp", "nixl"]


def pools(dtype=torch.float32):
    a = KVPool(40, 16, 3, 2, 32, dtype, "cpu")
    b = KVPool(64, 16, 3, 2, 32, dtype, "cpu")
    a.data.copy_(torch.randn(a.data.shape).to(dtype))
    return a, b


def wait_received(rx, sender, timeout=5.0):
    deadline = time.time() + timeout
    got, sent = [], []
    while time.time() < deadline and not got:
        sent += sender.poll_sent()
        got = rx.poll_received()
        time.sleep(0.002)
    return got, sent + sender.poll_sent()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_arrive_bit_exact_with_their_notification(name, dtype):
    assert name in available_backends()
    a, b = pools(dtype)
    tx = create_transfer(name, a, "p", "127.0.0.1")
    rx = create_transfer(name, b, "d", "127.0.0.1")
    src, dst = [5, 1, 33, 12, 7], [60, 3, 4, 41, 9]
    before = b.data.clone()
    rx.expect("r1", dst)
    tx.send("r1", "d", rx.endpoint(), src, dst, encode(KVReady("r1", 42, -0.5)))
    got, sent = wait_received(rx, tx)
    assert [r for r, _ in got] == ["r1"]
    assert decode(got[0][1]) == KVReady("r1", 42, -0.5)
    assert sent and sent[0].ok and sent[0].nbytes == len(src) * a.page_bytes
    for s, d in zip(src, dst):
        assert torch.equal(b.data[:, d].view(torch.uint8), a.data[:, s].view(torch.uint8))
    untouched = [p for p in range(b.num_pages) if p not in dst]
    assert torch.equal(b.data[:, untouched], before[:, untouched])
    assert tx.stats.count == 1 and tx.stats.bytes == len(src) * a.page_bytes
    tx.close()
    rx.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_a_peer_connected_ahead_of_its_first_send_is_held_and_served(name):
    """connect() sets a peer up before any send (engine.protocol.Introduce); once more is a no-op, a peer that
    left is not set up again by a late introduction, and an endpoint that is not one raises."""
    a, b = pools()
    tx = create_transfer(name, a, "p", "127.0.0.1")
    rx = create_transfer(name, b, "d", "127.0.0.1")
    tx.connect("d", rx.endpoint())
    tx.connect("d", rx.endpoint())
    assert tx.peers_held() == 1
    rx.expect("r1", [5])
    tx.send("r1", "d", rx.endpoint(), [3], [5], encode(KVReady("r1", 1)))
    got, sent = wait_received(rx, tx)
    assert [r for r, _ in got] == ["r1"] and sent and sent[0].ok
    assert torch.equal(b.data[:, 5], a.data[:, 3])
    tx.drop_peer("d")
    tx.connect("d", rx.endpoint())
    assert tx.peers_held() == 0
    if name == "nixl":  # (tcp's endpoint is an address: ZMQ connects to it lazily, whatever it is)
        with pytest.raises(Exception):
            tx.connect("x", b"not an endpoint")
        assert tx.peers_held() == 0
    tx.close()
    rx.close()


def test_a_prefill_worker_connects_to_the_decode_worker_it_is_introduced_to(played, caplog):
    from engine.protocol import Introduce

    dec = played.start("decode")
    pre = played.start("prefill")
    nixl = pre.transfers["nixl"]
    assert nixl.peers_held() == 0
    with caplog.at_level("WARNING", logger="engine.worker"):
        played.send(pre, Introduce("bogus", "nixl", b"not an endpoint"))
        played.send(pre, Introduce("nobody", "no-such-backend", b""))
        played.send(pre, Introduce(dec.worker_id, "nixl", dec.endpoints["nixl"]))
        played.pump(lambda g: nixl.peers_held() == 1, pre, dec)
    assert [r for r in caplog.records if "could not connect to transfer peer bogus" in r.getMessage()]
    alloc = played.allocate(dec, "r1")
    played.prefill(pre, dec, alloc, alloc.kv_timeout_s)
    got = played.pump(lambda g: finished(g, "r1"), pre, dec, timeout=30)
    assert not errors(got) and nixl.peers_held() == 1


@pytest.mark.parametrize("name", BACKENDS)
def test_page_lists_that_do_not_fit_the_pools_fail_the_send_and_write_nothing(name):
    a, b = pools()  # 40 and 64 pages
    tx = create_transfer(name, a, "p", "127.0.0.1")
    rx = create_transfer(name, b, "d", "127.0.0.1")
    before = b.data.clone()
    bad = {"r1": ([1, 2], [3]), "r2": ([1, 40], [3, 4]), "r3": ([1, -1], [3, 4])}
    if name == "nixl":  # one-sided: the sender is all that stands between a wrong index and the receiver's memory
        bad.update({"r4": ([1, 2], [3, 64]), "r5": ([1, 2], [-3, 4])})
    for rid, (src, dst) in bad.items():
        rx.expect(rid, dst)
        tx.send(rid, "d", rx.endpoint(), src, dst, encode(KVReady(rid, 1)))
    got, sent = wait_received(rx, tx, timeout=1.0)
    assert got == [] and torch.equal(b.data, before)
    assert sorted(r.rid for r in sent) == sorted(bad) and not any(r.ok for r in sent)
    assert all("out of range" in r.error or "differ in length" in r.error for r in sent), sent
    # The engine goes on: a good send after them lands.
    rx.expect("ok", [63])
    tx.send("ok", "d", rx.endpoint(), [39], [63], encode(KVReady("ok", 1)))
    got, sent = wait_received(rx, tx)
    assert [r for r, _ in got] == ["ok"] and sent[-1].ok
    assert torch.equal(b.data[:, 63], a.data[:, 39])
    tx.close()
    rx.close()


def test_tcp_drops_data_for_forgotten_or_mismatched_requests():
    a, b = pools()
    tx = create_transfer("tcp", a, "p", "127.0.0.1")
    rx = create_transfer("tcp", b, "d", "127.0.0.1")
    before = b.data.clone()
    rx.expect("gone", [1, 2])
    rx.forget("gone")  # aborted: its pages may already belong to someone else
    tx.send("gone", "d", rx.endpoint(), [3, 4], [1, 2], encode(KVReady("gone", 1)))
    rx.expect("other", [5, 6])
    tx.send("other", "d", rx.endpoint(), [3, 4], [7, 8], encode(KVReady("other", 1)))  # wrong pages
    got, _ = wait_received(rx, tx, timeout=1.0)
    assert got == []
    assert torch.equal(b.data, before)


def test_malformed_frames_are_dropped_not_fatal():
    a, b = pools()
    rx = create_transfer("tcp", b, "d", "127.0.0.1")
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PUSH)
    s.connect(rx.endpoint().decode())
    s.send_multipart([b"\x93garbage", b"xx"])
    s.send(b"single frame")
    time.sleep(0.2)
    assert rx.poll_received() == []
    assert decode(b"\xc1\xff not msgpack") is None
    assert decode(encode(Abort("x"))) == Abort("x")
    s.close(0)


def test_backend_agreement():
    both = {"tcp": b"t", "nixl": b"n"}
    assert agree(both, both) == "nixl"
    assert agree({"tcp": b"t"}, both) == "tcp"
    assert agree(both, both, "tcp") == "tcp"
    assert agree({"tcp": b"t"}, {"nixl": b"n"}) is None


def test_cuda_ipc_only_between_processes_of_one_machine():
    import msgspec

    from transfer.cuda_ipc import _Endpoint, machine_id

    def ep(machine, gpu=""):
        return msgspec.msgpack.encode(_Endpoint(machine, "tcp://x:1", [], [1], "bfloat16", gpu=gpu))

    here, there = {"cuda_ipc": ep(machine_id()), "tcp": b"t"}, {"cuda_ipc": ep("another-machine"), "tcp": b"t"}
    assert agree(here, dict(here)) == "cuda_ipc"
    assert agree(here, there) == "tcp"
    assert agree(here, there, "cuda_ipc") is None
    # Tensor-parallel workers publish every rank's endpoint; their machine is rank 0's.
    ranks_here = {"cuda_ipc": join_rank_endpoints([ep(machine_id()), ep(machine_id())]), "tcp": b"t"}
    ranks_there = {"cuda_ipc": join_rank_endpoints([ep("another-machine"), ep(machine_id())]), "tcp": b"t"}
    assert agree(ranks_here, dict(ranks_here)) == "cuda_ipc"
    assert agree(ranks_here, ranks_there) == "tcp"
    assert agree({"cuda_ipc": b"pdserve-ranks\x00\xc1", "tcp": b"t"}, ranks_here) == "tcp"
    # One machine, other GPUs: the copy kernel cannot write the peer's pool, so not cuda_ipc.
    gpu = lambda g: {"cuda_ipc": ep(machine_id(), g), "tcp": b"t"}  # noqa: E731
    assert agree(gpu("GPU-a"), gpu("GPU-a")) == "cuda_ipc"
    assert agree(gpu("GPU-a"), gpu("GPU-b")) == "tcp"
    ranks = lambda *gs: {"cuda_ipc": join_rank_endpoints([ep(machine_id(), g) for g in gs]), "tcp": b"t"}  # noqa: E731
    assert agree(ranks("GPU-a", "GPU-b"), ranks("GPU-a", "GPU-b")) == "cuda_ipc", "rank r with rank r, each on one GPU"
    assert agree(ranks("GPU-a", "GPU-b"), ranks("GPU-a", "GPU-c")) == "tcp"
    assert agree(ranks("GPU-a", "GPU-b"), gpu("GPU-a")) == "tcp", "ranks that do not pair up"


def test_per_rank_endpoints_round_trip_and_malformed_ones_are_refused():
    assert rank_endpoints(b"tcp://a:1") == [b"tcp://a:1"]
    assert join_rank_endpoints([b"tcp://a:1"]) == b"tcp://a:1"  # one rank: the plain endpoint, as before
    joined = join_rank_endpoints([b"tcp://a:1", b"tcp://a:2", b"\x00binary"])
    assert rank_endpoints(joined) == [b"tcp://a:1", b"tcp://a:2", b"\x00binary"]
    for bad in (b"pdserve-ranks\x00\xc1", b"pdserve-ranks\x00\x90", b"pdserve-ranks\x00\x92\x01\x02"):
        with pytest.raises(ValueError):
            rank_endpoints(bad)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_peer_that_restarts_under_the_same_id_gets_its_pages_and_a_dropped_peer_is_released(name):
    a, b = pools()
    tx = create_transfer(name, a, "p", "127.0.0.1")
    old = create_transfer(name, b, "d", "127.0.0.1")
    old.expect("r1", [3])
    tx.send("r1", "d", old.endpoint(), [1], [3], encode(KVReady("r1", 1)))
    got, sent = wait_received(old, tx)
    assert [r for r, _ in got] == ["r1"] and sent[0].ok
    old.close()

    # The same worker id, a new process: new pool, new endpoint. The sender must not reuse the old connection.
    fresh = KVPool(64, 16, 3, 2, 32, torch.float32, "cpu")
    new = create_transfer(name, fresh, "d", "127.0.0.1")
    new.expect("r2", [4])
    tx.send("r2", "d", new.endpoint(), [2], [4], encode(KVReady("r2", 2)))
    got, sent = wait_received(new, tx)
    assert [r for r, _ in got] == ["r2"] and sent[0].ok
    assert torch.equal(fresh.data[:, 4], a.data[:, 2])
    assert tx.peers_held() == 1

    tx.drop_peer("d")
    assert tx.peers_held() == 0
    tx.drop_peer("d")  # a second notice of the same departure is harmless
    # A send still addressed to the departed worker (a prefill already running when it died) fails at once.
    new.expect("r3", [5])
    tx.send("r3", "d", new.endpoint(), [3], [5], encode(KVReady("r3", 3)))
    sent = tx.poll_sent()
    assert [(r.rid, r.ok) for r in sent] == [("r3", False)] and "left" in sent[0].error
    assert tx.peers_held() == 0
    tx.close()
    new.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_peers_missing_from_the_registry_are_let_go_once_unused_and_can_come_back(name):
    """LivePeers: a peer that is not in the registry and was not used for a while is released (a PeerLeft for it
    was never sent); it is not marked departed, so if it was alive after all the next send reaches it."""
    a, b = pools()
    tx = create_transfer(name, a, "p", "127.0.0.1")
    rx = create_transfer(name, b, "d", "127.0.0.1")
    try:
        for i, (src, dst) in enumerate([([5, 1], [60, 3]), ([7, 8], [20, 21])]):
            rid = f"r{i}"
            rx.expect(rid, dst)
            tx.send(rid, "d", rx.endpoint(), src, dst, encode(KVReady(rid, 1)))
            got, sent = wait_received(rx, tx)
            assert [r for r, _ in got] == [rid] and sent[0].ok
            assert all(torch.equal(b.data[:, d], a.data[:, s]) for s, d in zip(src, dst))
            if i == 0:
                assert tx.peers_held() == 1
                assert tx.release_stale_peers({"p", "d"}, idle_s=0) == [], "in the registry: kept"
                assert tx.release_stale_peers(set(), idle_s=60) == [], "used a moment ago: kept"
                assert tx.release_stale_peers(set(), idle_s=0) == ["d"]
                assert tx.peers_held() == 0
        assert tx.peers_held() == 1, "connected again by the second send"
    finally:
        tx.close()
        rx.close()


def test_nixl_writes_to_a_receiver_that_died_end_as_failures_and_hold_nothing():
    """A receiver gone before the sender's UCX connected to it leaves the write in flight for good (UCX retries
    its connection and reports nothing); killed mid-write, NIXL raises from the status check instead of saying
    ERR. Either way the prefill worker must get a failure to report (the request is placed again) and let go
    of the source pages; a worker that comes back under the same id must be reachable at once."""
    from transfer.nixl import _nixl_api

    a, b = pools()
    tx = create_transfer("nixl", a, "p", "127.0.0.1")
    dead = create_transfer("nixl", b, "d", "127.0.0.1")
    endpoint = dead.endpoint()
    dead.close()
    try:
        tx.send("r1", "d", endpoint, [1, 2], [3, 4], encode(KVReady("r1", 1)))
        time.sleep(0.5)
        assert tx.poll_sent() == [] and tx.pending, "still in flight"
        tx.drop_peer("d")  # the coordinator's PeerLeft
        sent = tx.poll_sent()
        assert [(r.rid, r.ok) for r in sent] == [("r1", False)] and "left" in sent[0].error
        assert not tx.pending and tx.peers_held() == 0

        # Restarted under the same id while a write to the old process hangs: the new one gets its pages.
        tx.send("r2", "d", endpoint, [1], [3], encode(KVReady("r2", 2)))
        fresh = KVPool(64, 16, 3, 2, 32, torch.float32, "cpu")
        new = create_transfer("nixl", fresh, "d", "127.0.0.1")
        new.expect("r3", [4])
        tx.send("r3", "d", new.endpoint(), [2], [4], encode(KVReady("r3", 3)))
        got, sent = wait_received(new, tx)
        assert [r for r, _ in got] == ["r3"]
        assert sorted((r.rid, r.ok) for r in sent) == [("r2", False), ("r3", True)]
        assert torch.equal(fresh.data[:, 4], a.data[:, 2])

        # A status check that raises is that transfer's failure, not the worker's end.
        bindings = __import__(_nixl_api()[0].__module__.replace("_api", "_bindings"), fromlist=["x"])

        def disconnected(handle):
            raise bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

        new.expect("r4", [5])
        tx.send("r4", "d", new.endpoint(), [3], [5], encode(KVReady("r4", 4)))
        tx.agent.check_xfer_state = disconnected
        sent = tx.poll_sent()
        assert [(r.rid, r.ok) for r in sent] == [("r4", False)] and "REMOTE_DISCONNECT" in sent[0].error
        assert not tx.pending
        new.close()
    finally:
        tx.close()


def test_a_nixl_notification_poll_that_raises_is_tried_again_not_fatal():
    """The receiver's side of the same: NIXL's notification poll raising (a sender killed mid-write) must not
    take the decode worker down, and notifications still come with the next poll."""
    from transfer.nixl import _nixl_api

    bindings = __import__(_nixl_api()[0].__module__.replace("_api", "_bindings"), fromlist=["x"])
    a, b = pools()
    tx = create_transfer("nixl", a, "p", "127.0.0.1")
    rx = create_transfer("nixl", b, "d", "127.0.0.1")
    real, calls = rx.agent.get_new_notifs, []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
        return real()

    rx.agent.get_new_notifs = flaky
    try:
        rx.expect("r1", [3])
        tx.send("r1", "d", rx.endpoint(), [1], [3], encode(KVReady("r1", 1)))
        assert rx.poll_received() == []
        got, sent = wait_received(rx, tx)
        assert [r for r, _ in got] == ["r1"] and sent[0].ok
        assert torch.equal(b.data[:, 3], a.data[:, 1])
    finally:
        tx.close()
        rx.close()


class _Copy:
    """A stand-in for a copy's CUDA event: synchronize() returns once the test finishes the copy."""

    def __init__(self, fails: bool = False):
        import threading

        self.finished = threading.Event()
        self.fails = fails

    def synchronize(self):
        assert self.finished.wait(10)
        if self.fails:
            raise RuntimeError("an illegal memory access was encountered")


def test_cuda_ipc_notifications_leave_in_order_once_their_copies_finish():
    """The notifier thread of the cuda_ipc sender: a note goes out only after its copy, in the order the
    sends were made; a failed copy is reported and sends no note, and the thread carries on."""
    from transfer.cuda_ipc import _Notifier

    ctx = zmq.Context.instance()
    rx = ctx.socket(zmq.PULL)
    rx.bind("tcp://127.0.0.1:*")
    addr = rx.getsockopt_string(zmq.LAST_ENDPOINT)
    notifier = _Notifier(ctx, None)
    notifier.start()
    try:
        copies = {rid: _Copy(fails=rid == "r2") for rid in ("r1", "r2", "r3")}
        for rid, copy in copies.items():
            notifier.notify(rid, copy, addr, f"ready {rid}".encode())
        copies["r3"].finished.set()  # finishes first, but its note waits for r1's
        assert rx.poll(300) == 0
        copies["r1"].finished.set()
        assert rx.recv_multipart() == [b"r1", b"ready r1"]
        copies["r2"].finished.set()
        assert rx.recv_multipart() == [b"r3", b"ready r3"]
        results = [notifier.results.get(timeout=5) for _ in range(3)]
        assert results[0] == ("r1", None) and results[2] == ("r3", None)
        assert results[1][0] == "r2" and "illegal memory access" in results[1][1]
        # A peer that left: its socket is closed after the notes queued before; a later send reconnects.
        notifier.forget(addr)
        again = _Copy()
        again.finished.set()
        notifier.notify("r4", again, addr, b"ready r4")
        assert rx.recv_multipart() == [b"r4", b"ready r4"]
    finally:
        for copy in copies.values():
            copy.finished.set()
        notifier.stop()
        rx.close(0)
    assert not notifier.is_alive()


def test_cuda_ipc_page_lists_pad_what_a_shorter_send_leaves_and_refuse_bad_pages():
    """A send's page pairs go into a fixed buffer that its copy graph reads: entries past the send are -1
    (pairs the page-copy kernel skips), whatever a longer send before it or a refused one wrote there. Pairs
    that do not fit both pools are refused before any copy reads them."""
    from transfer.cuda_ipc import PageLists

    lists = PageLists(8, pin_memory=False)
    limits = (40, 64)  # the pools' pages: the sender's, the receiver's
    lists.write([3, 4, 5, 6, 7], [10, 11, 12, 13, 14], *limits)
    assert lists.host.tolist() == [[3, 4, 5, 6, 7, -1, -1, -1], [10, 11, 12, 13, 14, -1, -1, -1]]
    lists.write([9, 8], [1, 2], *limits)
    assert lists.host.tolist() == [[9, 8] + [-1] * 6, [1, 2] + [-1] * 6]
    with pytest.raises(ValueError, match="page lists"):
        lists.write([1, 2, 3, 2**40], [4, 5, 6, 7], *limits)  # the first three are written before the fourth fails
    lists.write([5], [6], *limits)
    assert lists.host.tolist() == [[5] + [-1] * 7, [6] + [-1] * 7]
    # Pages outside either pool are refused once written; the next send's padding covers them again.
    for src, dst, whose in (([1, 2, 40], [3, 4, 5], "source"), ([1, -2, 3], [3, 4, 5], "source"),
                            ([1, 2, 3], [3, 64, 5], "destination"), ([1, 2, 3], [-1, 4, 5], "destination")):
        with pytest.raises(ValueError, match=f"a {whose} page is out of range"):
            lists.write(src, dst, *limits)
        lists.write([39], [63], *limits)
        assert lists.host.tolist() == [[39] + [-1] * 7, [63] + [-1] * 7]
    with pytest.raises(ValueError, match="pages for a buffer of 8"):
        lists.write(list(range(9)), list(range(9)), *limits)
    with pytest.raises(ValueError):
        lists.write([1, 2], [3], *limits)
