"""Self-launch: `paratron train --nproc N` re-runs itself under torchrun's launcher.

torch.distributed's elastic agent starts and watches the workers exactly as
`torchrun --standalone --nproc_per_node N -m paratron ...` would; on a worker failure
it stops the others, so a broken rank never leaves its peers hanging.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from typing import Sequence


def run_under_torchrun(nproc: int, argv: Sequence[str]) -> int:
    """Run `python -m paratron ARGV` on `nproc` local processes; return the job's exit code."""
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
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "paratron", *argv)
    except ChildFailedError as failure:
        codes = [f.exitcode for f in failure.failures.values()]
        # A worker that exits 2 has already printed its one-line reason.
        return 2 if 2 in codes else 1
    return 0
