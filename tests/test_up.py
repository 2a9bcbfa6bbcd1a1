"""`pdserve up`: one ready line, and the whole cluster goes down on Ctrl-C or when any child dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from cluster import ROOT, free_port


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def start_up(*extra: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen, str]:
    """`pdserve up` with its ready line read; sigint_ignored: started as a shell starts a background job."""
    port = free_port()
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    p = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "--port", str(port), *extra,
                          "--max-total-tokens", "2048"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, preexec_fn=ignore)
    lines = []
    for line in p.stdout:  # until the ready line (or the end of output, if it never comes)
        lines.append(line)
        if line.startswith("pdserve ready"):
            break
    if not (lines and lines[-1].startswith(f"pdserve ready at http://127.0.0.1:{port}")):
        stop(p)
        raise AssertionError(f"no ready line: {lines}")
    return p, f"http://127.0.0.1:{port}"


def stop(p: subprocess.Popen) -> None:
    """SIGTERM lets `up` stop its children; SIGKILL is the last resort (children then die with it too)."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_gone(pids, timeout=20) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(alive(c) for c in pids):
            return True
        time.sleep(0.2)
    return False


def test_ready_line_then_ctrl_c_stops_everything():
    """Even started with SIGINT ignored (a background job of a shell), `up` stops its cluster on SIGINT."""
    p, url = start_up("--prefill", "1", "--decode", "1", sigint_ignored=True)
    try:
        kids = children(p.pid)
        assert len(kids) == 3  # coordinator, prefill, decode
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
        assert wait_gone(kids)
    finally:
        stop(p)


def test_a_dying_child_takes_the_cluster_down():
    p, _ = start_up("--colocated", "1")
    try:
        kids = children(p.pid)
        os.kill(kids[-1], signal.SIGKILL)  # the worker
        assert p.wait(timeout=30) == 1
        assert wait_gone(kids)
    finally:
        stop(p)


def test_children_die_with_a_killed_up():
    p, _ = start_up("--colocated", "1")
    kids = children(p.pid)
    p.kill()  # no chance to clean up: the children must still go
    p.wait()
    assert wait_gone(kids)


def test_another_distributions_kernels_package_is_named_not_imported_blindly(tmp_path):
    """Where Hugging Face's `kernels` (same import name) comes first on the path, the command line says so and
    exits, before any worker fails on a missing module."""
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("class CUDAProperties:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    r = subprocess.run([sys.executable, "-m", "coordinator.cli", "up", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is not pdserve's" in r.stderr and str(fake) in r.stderr
    ok = subprocess.run([sys.executable, "-m", "coordinator.cli", "up", "--help"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--prefill" in ok.stdout



def test_tensor_parallel_workers_of_up_get_gpus_of_their_own(monkeypatch):
    import pytest
    import torch

    from coordinator.cli import _gpu_plan

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert _gpu_plan(["--tp", "2"], 3) == [["--base-gpu-id", "0"], ["--base-gpu-id", "2"], ["--base-gpu-id", "4"]]
    assert _gpu_plan(["--tp-size", "4"], 3) == [["--base-gpu-id", "0"], ["--base-gpu-id", "4"], ["--base-gpu-id", "0"]]
    assert _gpu_plan(["--tp", "2", "--base-gpu-id", "6"], 2) == [[], []], "an explicit choice is the user's"
    assert _gpu_plan(["--max-total-tokens", "9"], 2) == [[], []], "one rank each: all on the first GPU, as before"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert _gpu_plan(["--tp", "2"], 2) == [[], []], "CPU ranks need no GPU"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="needs 2 GPUs"):
        _gpu_plan(["--tp", "2"], 1)


@pytest.mark.parametrize("flags, says", [
    (["--tp", "0"], "tp_size must be >= 1"),
    (["--prefill", "0"], "at least one prefill and one decode worker"),
    (["--decode", "-1"], "--decode must be >= 0"),
    (["--port", "70000"], "--port must be in [1, 65535]"),
    (["--kv-cache-dtype", "fp9"], "unknown kv_cache_dtype 'fp9'"),
    (["--chunked-prefill-size", "0"], "chunked_prefill_size must be >= 1"),
    (["--max-runing-requests", "8"], "unrecognized arguments: --max-runing-requests 8"),
    (["--model-path", "/nowhere/model"], "neither a directory nor a .gguf file"),
    (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid:"),
    (["--kv-cache-dtype", "int8"], "unknown kv_cache_dtype 'int8'"),
    (["--attention-backend", "triton"], "the triton backend runs on a GPU"),
])
def test_flags_no_worker_could_start_with_are_refused_before_any_child_starts(flags, says):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real machine's, not the tests'
    r = subprocess.run([sys.executable, "-m", "coordinator.cli", "up", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve up: ") and says in last
    assert "Traceback" not in r.stderr
    assert "coordinator:" not in r.stderr and "engine ready" not in r.stderr  # no child got as far as starting


def test_up_refuses_a_port_in_use_before_any_child_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "coordinator.cli", "up", "--port", str(port)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == f"pdserve up: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "engine ready" not in r.stderr


@pytest.mark.parametrize("flags, says", [
    (["--coordinator-addr", "garbage"], "--coordinator-addr must be tcp://HOST:PORT"),
    (["--coordinator-addr", "tcp://127.0.0.1:99999"], "--coordinator-addr must be tcp://HOST:PORT"),
    (["--coordinator-addr", "tcp://127.0.0.1:5", "--port", "-1"], "port must be in [0, 65535]"),
    (["--coordinator-addr", "tcp://127.0.0.1:5", "--transfer-timeout", "0"], "transfer_timeout_s must be > 0"),
    (["--coordinator-addr", "tcp://127.0.0.1:5", "--host", "192.0.2.1"], "cannot listen on tcp://192.0.2.1:*"),
])
def test_a_worker_refuses_addresses_it_could_not_use_in_one_line(flags, says):
    """A coordinator address ZMQ cannot parse was a traceback, one with a port out of range a worker that
    waited in silence, and a host not of this machine a traceback once the model had loaded."""
    r = subprocess.run([sys.executable, "-m", "coordinator.cli", "decode", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve decode: ") and says in last, last
    assert "Traceback" not in r.stderr
