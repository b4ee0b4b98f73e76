"""Self-launch: `paratron train --nproc N` re-runs itself under torchrun's launcher.

torch.distributed's elastic agent starts and watches the workers exactly as `torchrun` would;
on a worker failure it stops the others, so a broken rank never leaves its peers hanging, and
with --max-restarts it starts them all again (they resume from the newest intact checkpoint).
Across machines each node runs one agent: `--nnodes N --node-rank I --master-addr A` (torchrun's
static rendezvous) or `--rdzv-endpoint HOST:PORT` (its c10d rendezvous, where nodes restart
together); under Slurm the same comes from SLURM_* (`slurm_settings`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed import TCPStore

from paratron.config.schema import ParallelConfig
from paratron.distributed.parent import LAUNCHER_PID_ENV
from paratron.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

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


def needs_agent(parallel: ParallelConfig) -> bool:
    """Whether `paratron train` must start the workers (not run as one), when torchrun has not."""
    return parallel.nproc_per_node > 1 or parallel.nnodes > 1 or parallel.max_restarts > 0


def restart_count() -> int:
    """How many times the agent has restarted this job's workers (0 in the first attempt, or alone)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `gpu[003-010,12],cpu1` -> `gpu003`."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"unreadable Slurm node list {nodelist!r}")
    prefix, ranges = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def slurm_settings(env: Mapping[str, str], given: ParallelConfig) -> ParallelConfig:
    """Launch settings from Slurm's environment (one `paratron train` task per node, as in
    docs/launch.md's sbatch script): the nodes, this node's rank, node 0 of the allocation as the
    c10d rendezvous and the job id as its name. Settings given on the command line win; outside
    Slurm (no SLURM_JOB_ID, or one task per process) `given` is returned unchanged."""
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        return given
    nodes = int(env["SLURM_NNODES"])
    if int(env.get("SLURM_NTASKS", nodes)) != nodes:
        return given  # one task per process: srun is the launcher, torchrun is not needed
    defaults = ParallelConfig()
    meet = given.master_addr is None and given.rdzv_endpoint is None
    return dataclasses.replace(
        given,
        nnodes=given.nnodes if given.nnodes != defaults.nnodes else nodes,
        node_rank=given.node_rank if given.node_rank != defaults.node_rank else int(env.get("SLURM_NODEID", "0")),
        rdzv_endpoint=f"{first_host(env['SLURM_JOB_NODELIST'])}:{given.master_port}" if meet else given.rdzv_endpoint,
        rdzv_id=given.rdzv_id or f"slurm-{env['SLURM_JOB_ID']}",
    )


class _RestartNotice:
    """Says on the agent's stderr, in one line, each time the agent restarts the workers: it hears
    of restarts through torch elastic's metrics (remaining restarts, then the group's state), which
    it emits on every round of watching the workers."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.remaining = max_restarts

    def emit(self, metric: Any) -> None:
        if metric.name.endswith(".remaining_restarts"):
            self.remaining = metric.value
        elif metric.name.endswith((".failed", ".unhealthy")) and self.remaining > 0:
            restart = self.max_restarts - self.remaining + 1
            print(
                f"a rank failed: restarting the workers ({restart} of {self.max_restarts}, --max-restarts); "
                "they resume from the newest intact checkpoint",
                file=sys.stderr,
                flush=True,
            )


def _launch_config(settings: ParallelConfig) -> LaunchConfig:
    """The elastic agent's settings for this node."""
    from torch.distributed.launcher.api import LaunchConfig  # (start-up speed: docs/architecture.md)

    common = {
        "min_nodes": settings.nnodes,
        "max_nodes": settings.nnodes,
        "nproc_per_node": settings.nproc_per_node,
        "max_restarts": settings.max_restarts,
        "monitor_interval": 0.2,
    }
    if settings.rdzv_endpoint is not None:  # c10d: the nodes agree on restarts
        run_id = settings.rdzv_id or "paratron"
        return LaunchConfig(
            **common,
            run_id=run_id,
            rdzv_backend="c10d",
            rdzv_endpoint=settings.rdzv_endpoint,
            rdzv_configs={"join_timeout": settings.rdzv_timeout_seconds, "timeout": settings.rdzv_timeout_seconds},
        )
    if settings.nnodes > 1:  # static: node ranks fixed, node 0 hosts the store
        return LaunchConfig(
            **common,
            run_id=settings.rdzv_id or "paratron",
            rdzv_backend="static",
            rdzv_endpoint=f"{settings.master_addr}:{settings.master_port}",
            rdzv_configs={"rank": settings.node_rank, "timeout": settings.rdzv_timeout_seconds},
        )
    return LaunchConfig(  # one machine: a private rendezvous on a free port
        **common, run_id=f"paratron-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d", rdzv_endpoint="localhost:0"
    )


def run_under_torchrun(settings: ParallelConfig, argv: Sequence[str]) -> int:
    """Run `python -m paratron ARGV` on this node's processes; return the job's exit code."""
    # (torch's launcher is imported here, for start-up speed: workers never need it; docs/architecture.md)
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic import metrics
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    # The agent logs each failed worker; workers print their own reasons, so keep its report out.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // settings.nproc_per_node)))
    # Workers of each attempt meet in a store of their own: in the agent's shared one, gloo's
    # connection keys of the attempt before a restart are still there and the new workers dial them.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    metrics.configure(_RestartNotice(settings.max_restarts), group="torchelastic")
    with tempfile.TemporaryDirectory(prefix="paratron-errors-") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        try:
            meeting = agree_on_the_world(settings) if settings.nnodes > 1 and settings.rdzv_endpoint is None else None
            elastic_launch(_launch_config(settings), sys.executable)("-u", "-m", "paratron", *argv)
            del meeting  # (alive until the job ends: node 0's store server also serves the rendezvous)
        except SignalException:  # Ctrl-C or SIGTERM: the agent has stopped the workers
            print("interrupted", file=sys.stderr)
            return 130
        except (RendezvousError, DistNetworkError, DistStoreError) as exc:
            print(f"error: {not_met(settings, type(exc).__name__)}", file=sys.stderr)
            return 2
        except ChildFailedError as failure:
            return _failed(failure, settings, Path(error_dir))
        finally:
            del os.environ[ERROR_DIR_ENV], os.environ[LAUNCHER_PID_ENV]
    return 0


def not_met(settings: ParallelConfig, why: str) -> str:
    """The one line for nodes that did not all meet."""
    where = settings.rdzv_endpoint or f"{settings.master_addr}:{settings.master_port}"
    return (
        f"the nodes did not meet at {where} within {settings.rdzv_timeout_seconds:g} s ({why}); check --master-addr "
        f"/ --rdzv-endpoint, that every node has the same --nnodes {settings.nnodes} and its own --node-rank"
    )


def agree_on_the_world(settings: ParallelConfig) -> Any:
    """Static rendezvous: before any process starts, every node publishes its --nnodes and --nproc
    in node 0's store and checks the others'; nodes that disagree (which torch would leave waiting
    for processes that never come) get one line naming each node's settings (ConfigError)."""
    store = TCPStore(
        settings.master_addr,
        settings.master_port,
        is_master=settings.node_rank == 0,
        timeout=timedelta(seconds=settings.rdzv_timeout_seconds),
        wait_for_workers=False,
        multi_tenant=True,  # (the rendezvous that follows reuses this server in node 0's process)
    )
    mine = f"{settings.nnodes}x{settings.nproc_per_node}"
    store.set(f"paratron/world/{settings.node_rank}", mine)
    deadline = time.monotonic() + settings.rdzv_timeout_seconds
    seen: dict[int, str] = {}
    while time.monotonic() < deadline:
        for node in range(settings.nnodes):
            if node not in seen and store.check([f"paratron/world/{node}"]):
                seen[node] = store.get(f"paratron/world/{node}").decode()
        if any(value != mine for value in seen.values()) or len(seen) == settings.nnodes:
            break
        time.sleep(0.1)
    different = {node: value for node, value in seen.items() if value != mine}
    if not different and len(seen) < settings.nnodes:
        raise ConfigError(not_met(settings, f"{len(seen)} of {settings.nnodes} nodes came: {sorted(seen)}"))
    if different:
        _read_by_every_node(store, settings, seen, deadline)
        others = ", ".join(f"node {n} has {v}" for n, v in sorted(different.items()))
        raise ConfigError(
            f"the nodes disagree on the world (--nnodes x --nproc): node {settings.node_rank} has {mine}, {others}; "
            "start every node with the same --nnodes and --nproc"
        )
    return store


def _read_by_every_node(store: Any, settings: ParallelConfig, seen: dict[int, str], deadline: float) -> None:
    """Before nodes that disagree stop: each says it has read the others' settings, and node 0, whose process
    holds the store, waits for those it heard from (until the rendezvous deadline), so that none loses the store
    before it can name the disagreement."""
    store.set(f"paratron/world/read/{settings.node_rank}", "1")
    if settings.node_rank != 0:
        return
    others = [f"paratron/world/read/{node}" for node in seen if node != 0]
    while others and time.monotonic() < deadline and not store.check(others):
        time.sleep(0.1)


def _failed(failure: Any, settings: ParallelConfig, error_dir: Path) -> int:
    """The job's exit code after its workers failed (past every restart), with one line saying so."""
    codes = {rank: f.exitcode for rank, f in failure.failures.items()}
    if 2 in codes.values():  # a user error: the workers' one line
        messages = sorted(error_dir.glob("rank*.txt"))
        if codes.get(0) != 2 and messages:
            print(f"error: {messages[0].read_text(encoding='utf-8')}", file=sys.stderr)
        return 2
    rank, code = min(codes.items())
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    restarts = f" after {settings.max_restarts} restarts (--max-restarts)" if settings.max_restarts else ""
    print(f"error: rank {rank} {how}{restarts}; the job stopped", file=sys.stderr)
    return 1
