"""A launched worker ends with its launcher: the first thing `python -m paratron` does in a worker.

Kept free of torch (and of the rest of the package) so that it runs before anything slow: a
launcher killed while its worker is still importing torch must not leave that worker behind to
train and save beside the next job.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

LAUNCHER_PID_ENV = "PARATRON_LAUNCHER_PID"
"""The launcher's pid, for its workers: the parent each must still have when it starts."""
PR_SET_PDEATHSIG = 1
"""prctl's option (linux/prctl.h): the signal this process gets when its parent ends."""
WORKER_PARENT_ENV = "PARATRON_WORKER_PARENT"
"""Set by `end_with_launcher` in a worker: the parent it started under, which its watchdog watches."""

_armed = False


def end_with_launcher(parent: int) -> None:
    """End when the launcher ends, even by SIGKILL, which gives the launcher no chance to stop
    its workers. On Linux the kernel sends SIGKILL on the parent's death (PR_SET_PDEATHSIG).
    A launcher that died before that was set shows in the parent pid, which must still be the
    launcher's (it passes it in LAUNCHER_PID_ENV) or, under plain torchrun, `parent`, the one
    read as the worker started. Elsewhere the watchdog's thread watches the parent pid. A process
    started otherwise (by hand, by srun) is left alone: its parent is no launcher. Called twice
    (by `__main__` and by the command line's `main`), the second call does nothing."""
    global _armed
    if _armed:
        return
    _armed = True
    if LAUNCHER_PID_ENV not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    expected = int(os.environ.pop(LAUNCHER_PID_ENV, parent))  # (popped: not this worker's children's launcher)
    if os.getppid() != expected:
        print(f"[rank {os.environ.get('RANK', '?')}] stopped: its launcher is gone", file=sys.stderr, flush=True)
        os._exit(1)
    os.environ[WORKER_PARENT_ENV] = str(expected)


def expected_parent() -> int | None:
    """The parent this worker started under (None outside a launched worker)."""
    return int(os.environ[WORKER_PARENT_ENV]) if WORKER_PARENT_ENV in os.environ else None
