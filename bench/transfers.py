"""The KV transfer rows: a 4096-token request's pages between two processes on one GPU, through cuda_ipc
(against a contiguous copy of the same bytes), NIXL and TCP."""

from __future__ import annotations

import statistics
import time

import torch

from bench.measure import in_graph, sync, timed


IPC_LAYOUT = dict(num_layers=32, page_size=16, kv_heads=8, head_dim=128)  # the 8B shape


def kv_bytes_per_token_8b() -> int:
    return IPC_LAYOUT["num_layers"] * 2 * IPC_LAYOUT["kv_heads"] * IPC_LAYOUT["head_dim"] * 2


def _ipc_receiver(to_parent, from_parent, num_pages: int) -> None:
    """The decode side of the cuda_ipc row, in its own process: export a pool, await pages, checksum them."""
    from kvstore import KVPool
    from transfer.cuda_ipc import CudaIpcTransfer

    pool = KVPool(num_pages, dtype=torch.bfloat16, device="cuda", **IPC_LAYOUT)
    t = CudaIpcTransfer(pool, "decode", "127.0.0.1")
    to_parent.put(t.endpoint())
    dst, rounds = from_parent.get()
    got = 0
    deadline = time.time() + 120
    while got < rounds and time.time() < deadline:
        got += len(t.poll_received())
        time.sleep(0.001)
    idx = torch.tensor(dst, device="cuda")
    to_parent.put((got, pool.data.index_select(1, idx).view(torch.int16).to(torch.int64).sum().item()))


def cuda_ipc_row(tokens: int = 4096) -> tuple[float, float, bool]:
    """(ms to move a request's scattered pages into another process's pool, ms of a contiguous device
    copy of the same bytes, bit-exact?)."""
    import multiprocessing as mp

    from kvstore import KVPool
    from transfer.cuda_ipc import CudaIpcTransfer

    n, pages = tokens // IPC_LAYOUT["page_size"], 1024
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_receiver, args=(to_parent, from_parent, pages))
    child.start()
    endpoint = to_parent.get(timeout=120)
    pool = KVPool(pages, dtype=torch.bfloat16, device="cuda", **IPC_LAYOUT)
    pool.data.normal_()
    g = torch.Generator().manual_seed(0)
    src = (torch.randperm(pages - 1, generator=g)[:n] + 1).tolist()
    dst = (torch.randperm(pages - 1, generator=g)[:n] + 1).tolist()
    rounds = 21
    from_parent.put((dst, rounds))
    t = CudaIpcTransfer(pool, "prefill", "127.0.0.1")
    remote, _ = t._peer("decode", endpoint)
    src_t = torch.tensor(src, dtype=torch.int32, device="cuda")
    dst_t = torch.tensor(dst, dtype=torch.int32, device="cuda")
    import kernels.page_copy as pc

    best, default = None, (pc.CHUNK, pc.WARPS)
    for chunk in (2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            pc.CHUNK, pc.WARPS = chunk, warps
            # Device time, in a graph as a send runs it: a launch's host time would blur 10 us differences.
            k = in_graph(lambda: pc.copy_pages(pool.data, remote, src_t, dst_t), 10)
            print(f"  page copy into the mapped pool, chunk {chunk} warps {warps}: {k * 1e3:.3f} ms", flush=True)
            if best is None or k < best[0]:
                best = (k, chunk, warps)
    pc.CHUNK, pc.WARPS = default  # the sends below run as a worker runs them
    # The same kernel into a second pool of this process: what the IPC mapping itself costs, if anything.
    local = torch.empty_like(pool.data)
    k_local = in_graph(lambda: pc.copy_pages(pool.data, local, src_t, dst_t), 10)
    k_remote = in_graph(lambda: pc.copy_pages(pool.data, remote, src_t, dst_t), 10)
    print(f"  page copy, default setting: into a pool of this process {k_local * 1e3:.3f} ms, into the mapped "
          f"pool {k_remote * 1e3:.3f} ms", flush=True)
    local = None  # noqa: F841 (frees the 2 GB before the sends)
    times, device_times = [], []
    for i in range(rounds):
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        t.send(f"r{i}", "decode", endpoint, src, dst, b"ready")
        end.record()
        sync()
        times.append(time.perf_counter() - t0)
        device_times.append(start.elapsed_time(end) / 1e3)
        while not t.poll_sent():
            time.sleep(0.001)
    got, checksum = to_parent.get(timeout=120)
    child.join(timeout=60)
    expect = pool.data.index_select(1, torch.tensor(src, device="cuda")).view(torch.int16).to(torch.int64).sum().item()
    nbytes = n * pool.page_bytes
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    copy = timed(lambda: b.copy_(a), 20)
    t.close()
    # Where the host time of a send goes (each phase as send() does it, median of 5).
    phases = {"pinned buffer + fill": [], "async copy of the lists": [], "page-copy launch": [], "event": []}
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        host = torch.empty(2 * n, dtype=torch.int32, pin_memory=True)
        host.numpy()[:n] = src
        host.numpy()[n:] = dst
        t1 = time.perf_counter()
        lists = host.to("cuda", non_blocking=True)
        t2 = time.perf_counter()
        pc.copy_pages(pool.data, remote, lists[:n], lists[n:])
        t3 = time.perf_counter()
        torch.cuda.Event().record()
        t4 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k].append(v)
        sync()
    print("  cuda_ipc send, host us per phase: " +
          ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in phases.items()), flush=True)
    print(f"  cuda_ipc: best chunk {best[1]} warps {best[2]}, kernel alone {best[0] * 1e3:.3f} ms (default "
          f"{default}); send() "
          f"host wall ms {[round(x * 1e3, 3) for x in times]}, device ms {[round(x * 1e3, 3) for x in device_times]}",
          flush=True)
    return statistics.median(times[1:]), statistics.median(device_times[1:]), copy, got == rounds and checksum == expect


def _transfer_receiver(backend: str, to_parent, from_parent, num_pages: int) -> None:
    """The decode side of a transfer row, in its own process: a GPU pool behind `backend`; await `rounds`
    requests' pages, then checksum them."""
    from kvstore import KVPool
    from transfer import create_transfer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pool = KVPool(num_pages, dtype=torch.bfloat16, device=dev, **IPC_LAYOUT)
    t = create_transfer(backend, pool, "decode", "127.0.0.1")
    to_parent.put(t.endpoint())
    dst, rounds = from_parent.get()
    for i in range(rounds):
        t.expect(f"r{i}", dst)
    got = 0
    deadline = time.time() + 120
    while got < rounds and time.time() < deadline:
        got += len(t.poll_received())
        time.sleep(0.001)
    idx = torch.tensor(dst, device=dev)
    to_parent.put((got, pool.data.index_select(1, idx).view(torch.int16).to(torch.int64).sum().item()))
    t.close()


def transfer_row(backend: str, tokens: int) -> tuple[float, bool]:
    """(seconds per send of `tokens` tokens of 8B KV, scattered pages, GPU to GPU between two processes,
    until the sender sees it complete; bit-exact at the receiver?) through a transfer engine (nixl, tcp)."""
    import multiprocessing as mp

    from engine.protocol import KVReady, encode
    from kvstore import KVPool
    from transfer import create_transfer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n, pages, rounds = tokens // IPC_LAYOUT["page_size"], 2 * tokens // IPC_LAYOUT["page_size"] + 1, 4
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_transfer_receiver, args=(backend, to_parent, from_parent, pages))
    child.start()
    endpoint = to_parent.get(timeout=120)
    pool = KVPool(pages, dtype=torch.bfloat16, device=dev, **IPC_LAYOUT)
    pool.data.normal_()
    g = torch.Generator().manual_seed(1)
    src = (torch.randperm(pages - 1, generator=g)[:n] + 1).tolist()
    dst = (torch.randperm(pages - 1, generator=g)[:n] + 1).tolist()
    from_parent.put((dst, rounds))
    t = create_transfer(backend, pool, "prefill", "127.0.0.1")
    times, ok = [], True
    for i in range(rounds):
        sync()
        t0 = time.perf_counter()
        t.send(f"r{i}", "decode", endpoint, src, dst, encode(KVReady(f"r{i}", 0)))
        done = []
        while not done and time.perf_counter() - t0 < 60:
            done = t.poll_sent()
            time.sleep(0.0002)
        times.append(time.perf_counter() - t0)
        ok = ok and bool(done) and done[0].ok
    got, checksum = to_parent.get(timeout=180)
    child.join(timeout=60)
    t.close()
    expect = pool.data.index_select(1, torch.tensor(src, device=dev)).view(torch.int16).to(torch.int64).sum().item()
    return statistics.median(times[1:]), ok and got == rounds and checksum == expect


def transfer_rows(rows: list) -> None:
    """KV transfer between two processes on this GPU: cuda_ipc against a contiguous copy, then nixl and tcp."""
    from transfer import available_backends

    t, td, copy, exact = cuda_ipc_row()
    rows.append((f"cuda_ipc, 4096 tokens of 8B KV, scattered, into another process: device ms of the send "
                 f"(copy ms); exact={exact}", td * 1e3, copy * 1e3, td / copy, "<= 1.25"))
    rows.append(("cuda_ipc, the same: host wall ms of send() until the pages are in place (copy ms)", t * 1e3,
                 copy * 1e3, t / copy, "(for comparison)"))
    print(rows[-2:], flush=True)
    for backend in [b for b in ("nixl", "tcp") if b in available_backends(on_gpu=True)]:
        tokens = 1024
        try:
            t, exact = transfer_row(backend, tokens)
            nbytes = tokens * kv_bytes_per_token_8b()
            rows.append((f"{backend}, {tokens} tokens of 8B KV, scattered, GPU to GPU between processes: ms per "
                         f"send (GB/s); exact={exact}", t * 1e3, nbytes / t / 1e9, None, "(for comparison)"))
        except Exception as ex:
            rows.append((f"{backend} transfer between processes on the GPU", None, None, None,
                         f"failed: {ex!r:.120}"))
        print(rows[-1], flush=True)
