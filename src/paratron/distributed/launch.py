"""Self-launch: `paratron train --nproc N` re-runs itself under torchrun's launcher.

torch.distributed's elastic agent starts and watches the workers exactly as
`torchrun --standalone --nproc_per_node N -m paratron ...` would; on a worker failure
it stops the others, so a broken rank never leaves its peers hanging.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

ERROR_DIR_ENV = "PARATRON_ERROR_DIR"
"""Where workers other than rank 0 leave their one-line error message for the launcher."""


def report_worker_error(message: str) -> None:
    """Print a user error once for the whole job: rank 0 prints; other self-launched ranks leave
    it for the launcher, which prints it only if rank 0 had nothing to say."""
    rank = os.environ.get("RANK", "0")
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if rank != "0" and error_dir:
        Path(error_dir, f"rank{int(rank):06d}.txt").write_text(message, encoding="utf-8")
    else:
        prefix = "" if rank == "0" else f"[rank {rank}] "
        print(f"{prefix}error: {message}", file=sys.stderr)


def run_under_torchrun(nproc: int, argv: Sequence[str]) -> int:
    """Run `python -m paratron ARGV` on `nproc` local processes; return the job's exit code."""
    # (torch's launcher is imported lazily, for start-up speed: workers never need it)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs each failed worker; workers print their own reasons, so keep its report out.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"paratron-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
    )
    with tempfile.TemporaryDirectory(prefix="paratron-errors-") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir
        try:
            elastic_launch(config, sys.executable)("-u", "-m", "paratron", *argv)
        except SignalException:  # Ctrl-C or SIGTERM: the agent has stopped the workers
            print("interrupted", file=sys.stderr)
            return 130
        except ChildFailedError as failure:
            codes = {rank: f.exitcode for rank, f in failure.failures.items()}
            if 2 not in codes.values():
                return 1  # an internal failure: the worker printed its traceback
            messages = sorted(Path(error_dir).glob("rank*.txt"))
            if codes.get(0) != 2 and messages:
                print(f"error: {messages[0].read_text(encoding='utf-8')}", file=sys.stderr)
            return 2
        finally:
            del os.environ[ERROR_DIR_ENV]
    return 0
