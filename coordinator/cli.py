"""`pdserve`: coordinator, prefill, decode and colocated workers, and `up` for a local cluster."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from engine.args import EngineArgs
from engine.children import die_with_parent


def _log(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _add_coordinator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 30000)))
    p.add_argument("--zmq-host", default="127.0.0.1")
    p.add_argument("--zmq-port", type=int, default=None)
    p.add_argument("--model-path", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--redis-url", default=None, help="worker registry in Redis (default: in the coordinator)")
    p.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    p.add_argument("--transfer-backend", default="auto", choices=["auto", "tcp", "nixl", "cuda_ipc"])
    p.add_argument("--admission-timeout", type=float, default=30.0)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-request-bytes", type=int, default=64 << 20, help="largest request body taken (413 beyond)")
    p.add_argument("--lease-timeout", type=float, default=15.0,
                   help="seconds workers go on with this coordinator's requests after they last heard from it "
                        "(it renews every second); past them, a coordinator taken for dead has its requests ended")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=10.0,
                   help="seconds the requests in flight may finish after SIGTERM; those still running then end "
                        "with an error (503) and are freed on their workers")


def _add_worker_args(p: argparse.ArgumentParser, role: str | None) -> None:
    EngineArgs.add_cli_args(p)
    if role is None:
        p.add_argument("--role", default="colocated", choices=["prefill", "decode", "colocated"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="control port (default: any free port)")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--coordinator-addr", default=None, help="the coordinator's ZMQ address (no Redis)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--transfer-backends", default="auto", help="auto, or a list such as tcp,nixl")
    p.add_argument("--transfer-timeout", type=float, default=60.0,
                   help="seconds a decode worker holds pages for a prompt's KV; prompts the prefill workers have "
                        "not computed by then fail")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--graceful-shutdown-timeout", type=float, default=10.0,
                   help="seconds the worker finishes its requests after SIGTERM, taking no new ones; those still "
                        "running then are placed again elsewhere (a second SIGTERM stops it at once)")
    p.add_argument("--skip-server-warmup", action="store_true",
                   help="announce the worker without first running two short requests of its own (the first "
                        "client then waits for the kernels' first calls)")


def run_coordinator(ns) -> None:
    from coordinator.server import CoordinatorArgs, run_coordinator as run

    try:
        args = CoordinatorArgs(host=ns.host, port=ns.port, zmq_host=ns.zmq_host, zmq_port=ns.zmq_port,
                               model_path=ns.model_path, served_model_name=ns.served_model_name,
                               redis_url=ns.redis_url, api_keys=tuple(ns.api_key),
                               transfer_backend=ns.transfer_backend, admission_timeout_s=ns.admission_timeout,
                               context_length=ns.context_length, max_request_bytes=ns.max_request_bytes,
                               lease_timeout_s=ns.lease_timeout,
                               graceful_shutdown_timeout_s=ns.graceful_shutdown_timeout)
    except ValueError as e:
        raise SystemExit(f"pdserve coordinator: {e}") from None
    run(args)


def run_worker(ns, role: str) -> None:
    from engine.worker import Worker, WorkerArgs

    if ns.tp_size > 1 and ns.dist_init_addr is None:
        from engine.tp_worker import local_dist_addr

        ns.dist_init_addr = local_dist_addr()  # (EngineArgs wants one with tp_size > 1)
    try:
        args = WorkerArgs(role=role, host=ns.host, port=ns.port, redis_url=ns.redis_url,
                          coordinator_addr=ns.coordinator_addr, worker_id=ns.worker_id,
                          transfer_backends=ns.transfer_backends, transfer_timeout_s=ns.transfer_timeout,
                          served_model_name=ns.served_model_name,
                          graceful_shutdown_timeout_s=ns.graceful_shutdown_timeout,
                          skip_server_warmup=ns.skip_server_warmup, engine=EngineArgs.from_cli_args(ns))
        worker = Worker(args)
    except (ValueError, FileNotFoundError) as e:  # a flag or a model that cannot work: say which, no traceback
        raise SystemExit(f"pdserve {role}: {e}") from None
    worker.run()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _gpu_plan(engine_argv: list[str], workers: int) -> list[list[str]]:
    """Extra flags per worker of `up`: with --tp N on a GPU machine, worker k's ranks take the N GPUs from
    k * N on (round the machine's GPUs, so workers share them when there are fewer GPUs than ranks). Without
    tensor parallelism every worker stays on the first GPU, as before."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=None)
    p.add_argument("--device", default="auto")
    known, _ = p.parse_known_args(engine_argv)
    if known.tp_size <= 1 or known.base_gpu_id is not None or known.device != "auto":
        return [[] for _ in range(workers)]
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return [[] for _ in range(workers)]
    if count < known.tp_size:
        raise SystemExit(f"pdserve up: --tp {known.tp_size} needs {known.tp_size} GPUs, this machine has {count}")
    per = count // known.tp_size  # workers that fit side by side
    return [["--base-gpu-id", str((k % per) * known.tp_size)] for k in range(workers)]


def check_up(ns, engine_argv: list[str]) -> None:
    """Refuse what would make a child exit at start, before any starts: the cluster's shape, the port, and the
    engine flags every worker gets (parsed and validated as a worker will, so a typo is one line here instead
    of a child's usage message and a cluster stopping)."""
    def refuse(msg: str):
        raise SystemExit(f"pdserve up: {msg}")

    for name in ("prefill", "decode", "colocated"):
        if getattr(ns, name) < 0:
            refuse(f"--{name} must be >= 0, got {getattr(ns, name)}")
    if ns.colocated == 0 and (ns.prefill < 1 or ns.decode < 1):
        refuse(f"a disaggregated cluster needs at least one prefill and one decode worker, got --prefill "
               f"{ns.prefill} --decode {ns.decode} (or ask for --colocated N)")
    if not 1 <= ns.port <= 65535:
        refuse(f"--port must be in [1, 65535], got {ns.port}")
    p = argparse.ArgumentParser(prog="pdserve up", add_help=False)
    _add_worker_args(p, "prefill")
    try:
        wns, unknown = p.parse_known_args(engine_argv)
    except SystemExit:  # argparse has printed what is wrong
        raise SystemExit(2) from None
    if unknown:
        refuse(f"unrecognized arguments: {' '.join(unknown)}")
    if wns.tp_size > 1 and wns.dist_init_addr is None:
        wns.dist_init_addr = "tcp://127.0.0.1:0"  # (each worker picks its own; only the others are checked)
    try:
        EngineArgs.from_cli_args(wns)
    except ValueError as e:
        refuse(str(e))


def run_up(ns, engine_argv: list[str]) -> int:
    """Start a coordinator and workers as child processes; stop them all on Ctrl-C or when one dies."""
    from engine.loader import resolve_model_dir

    check_up(ns, engine_argv)
    try:
        resolve_model_dir(ns.model_path)  # convert a GGUF once, before every child wants it
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"pdserve up: {e}") from None
    try:  # a host that is not this machine's, or a port in use, is told here rather than by a child's death
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
            s.bind((ns.host, ns.port))
        zmq_port = _free_port(ns.host)
    except OSError as e:
        raise SystemExit(f"pdserve up: cannot listen on {ns.host}:{ns.port}: {e.strerror or e}") from None
    me = [sys.executable, "-m", "coordinator.cli"]
    common = ["--model-path", ns.model_path] if ns.model_path else []
    coord = me + ["coordinator", "--host", ns.host, "--port", str(ns.port), "--zmq-host", ns.host,
                  "--zmq-port", str(zmq_port), "--transfer-backend", ns.transfer_backend,
                  # the workers stop with it: nobody is left to finish a request
                  "--graceful-shutdown-timeout", "0"] + common
    if ns.redis_url:
        coord += ["--redis-url", ns.redis_url]
    for key in ns.api_key:
        coord += ["--api-key", key]
    reach = ["--redis-url", ns.redis_url] if ns.redis_url else ["--coordinator-addr", f"tcp://{ns.host}:{zmq_port}"]
    plan = [("prefill", ns.prefill), ("decode", ns.decode)] if ns.colocated == 0 else [("colocated", ns.colocated)]
    cmds = [coord]
    gpus = _gpu_plan(engine_argv, sum(n for _, n in plan))
    for role, n in plan:
        for _ in range(n):
            cmds.append(me + ["worker", "--role", role, "--host", ns.host, "--graceful-shutdown-timeout", "0"]
                        + reach + common + engine_argv + gpus.pop(0))
    # Ctrl-C and SIGTERM only ask the loop below to stop: no exception lands inside a library call, and an
    # `up` started as a background job (which inherits SIGINT ignored) still stops on SIGINT.
    stopping: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _: stopping.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, _: stopping.append(signum))
    children = [subprocess.Popen(c, preexec_fn=die_with_parent) for c in cmds]

    def stop():
        for c in children:
            if c.poll() is None:
                c.terminate()
        deadline = time.time() + 10
        for c in children:
            try:
                c.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                c.kill()

    url = f"http://{ns.host}:{ns.port}"
    ready = False
    try:
        while not stopping:
            dead = [c for c in children if c.poll() is not None]
            if dead:
                print(f"pdserve: a child process exited (code {dead[0].returncode}); stopping the cluster",
                      file=sys.stderr, flush=True)
                return 1
            if not ready:
                try:
                    with urllib.request.urlopen(f"{url}/health/ready", timeout=1) as r:
                        ready = r.status == 200
                except OSError:
                    pass
                if ready:
                    desc = f"{ns.colocated} colocated" if ns.colocated else f"{ns.prefill} prefill + {ns.decode} decode"
                    print(f"pdserve ready at {url} ({desc})", flush=True)
            time.sleep(0.2)
        return 0
    finally:
        stop()


def check_own_kernels() -> None:
    """Stop with a clear message where another distribution's `kernels` package stands in for ours (see
    kernels/__init__.py), instead of an ImportError deep inside the first worker."""
    import kernels

    if getattr(kernels, "OWNER", None) != "pdserve":
        raise SystemExit(f"pdserve: the `kernels` package at {getattr(kernels, '__file__', None)} is not pdserve's "
                         "(Hugging Face's `kernels` distribution, which transformers >= 5.25 installs, has the same "
                         "import name); install pdserve in an environment without it")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check_own_kernels()
    ap = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    ap.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "info"))
    ap.add_argument("--version", action="version", version=f"pdserve {package_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_coordinator_args(sub.add_parser("coordinator", help="the HTTP front door"))
    _add_worker_args(sub.add_parser("prefill", help="a prefill worker"), "prefill")
    _add_worker_args(sub.add_parser("decode", help="a decode worker"), "decode")
    _add_worker_args(sub.add_parser("worker", help="a worker of any role"), None)
    up = sub.add_parser("up", help="a local cluster: coordinator + workers (engine flags pass to workers)")
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--colocated", type=int, default=0)
    up.add_argument("--model-path", default=None)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=int(os.environ.get("PORT", 30000)))
    up.add_argument("--redis-url", default=None)
    up.add_argument("--api-key", action="append", default=[])
    up.add_argument("--transfer-backend", default="auto", choices=["auto", "tcp", "nixl", "cuda_ipc"])
    ns, rest = ap.parse_known_args(argv)
    _log(ns.log_level)
    if ns.cmd == "up":
        return run_up(ns, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if ns.cmd == "coordinator":
        run_coordinator(ns)
    elif ns.cmd == "worker":
        run_worker(ns, ns.role)
    else:
        run_worker(ns, ns.cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
