"""Child processes (the workers of `pdserve up`, the ranks of a tensor-parallel worker) that never outlive
the process that started them."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Run in the child before exec (Popen's preexec_fn): get SIGTERM when the parent dies, even by SIGKILL
    (Linux), so that no process is left behind holding a GPU or a port."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
