"""Run a function on N local ranks of this machine and report each rank's failure.

`run_ranks(fn, n, *args)` spawns n processes with the torchrun environment variables set
(RANK, WORLD_SIZE, MASTER_ADDR, ...), calls `fn(*args)` in each, and returns the list of
return values in rank order. If any rank raises, exits or hangs past the timeout, every
rank is stopped and one AssertionError lists what happened on each rank.

It is how the tests and benchmarks compare a multi-rank run with one process (gloo on the
CPU, no torchrun needed), and how a user tries a parallel layout from a script:
`fn` calls `paratron.distributed.initialize()` as under torchrun. `fn` and its arguments must
be picklable (a module-level function), since each rank is a fresh process that imports it.

Where the system can fork (Linux, macOS), ranks are forked from multiprocessing's fork server,
which imported torch and paratron's trainer once (`PRELOADED`): a rank then starts in a fraction
of a second, where a fresh interpreter spends seconds of CPU importing torch, the larger part of
a small test's time. Elsewhere each rank is a `spawn` process. Either way a rank gets the
caller's environment, working directory and import path as they are at the call (though what is
read only as a process starts, such as the C library's MALLOC_* settings, is the server's: a
benchmark that sets those spawns its processes itself).
"""

from __future__ import annotations

import os
import pickle
import queue
import random
import socket
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

PRELOADED = ["torch", "paratron.training.run", "torch._dynamo", "matplotlib.pyplot"]
"""What the fork server imports once for every rank it starts: torch, the trainer, and what a rank
would otherwise import on its first run, seconds of CPU each time: torch._dynamo (torch imports it
as a model is built under `torch.device(...)`, as every rank does; 2.4 s) and matplotlib (the loss
plot; 0.9 s)."""
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux says which ports it hands out as the local end of outgoing connections."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the ranks' rendezvous (MASTER_PORT).

    It lies below the range the system hands out to outgoing connections where the system says
    which that is: a client that keeps connecting to a port nobody listens on yet (a node that
    starts before the one hosting the store) can be given that very port as its own end, connect
    to itself and hold it, and the store then fails to listen there."""
    low = int(EPHEMERAL_PORTS.read_text().split()[0]) if EPHEMERAL_PORTS.is_file() else 0
    for port in random.Random().sample(range(10_000, low), min(64, max(low - 10_000, 0))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_environment(rank: int, world: int, port: int) -> None:
    """Set what torchrun would set for local rank `rank` of `world` (rendezvous on 127.0.0.1:`port`)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def rank_context() -> Any:
    """The multiprocessing context ranks start in: the fork server with `PRELOADED` imported
    where there is one, else `spawn`."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # (read when the server starts: at the first call)
    return context


class CallerOutput:
    """The caller's standard output and error as they are at the call (a terminal, a log, a test's
    capture), carried to a rank as duplicated file descriptors: a forked rank would otherwise write
    where the fork server's pointed when it started."""

    def __init__(self, fds: tuple[int | None, ...] = (1, 2)) -> None:
        self.fds = tuple(fd if fd is not None and _is_open(fd) else None for fd in fds)

    def __reduce__(self) -> tuple[Callable, tuple]:  # (only while a process starts: DupFd needs it)
        return CallerOutput._arrived, tuple(None if fd is None else reduction.DupFd(fd) for fd in self.fds)

    @staticmethod
    def _arrived(*duplicates: Any) -> CallerOutput:
        received = CallerOutput(())
        received.fds = tuple(None if d is None else d.detach() for d in duplicates)
        return received

    def attach(self) -> None:
        """In the rank: write to the caller's output and error."""
        for target, fd in zip((1, 2), self.fds):
            if fd is not None and fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _worker(
    rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    results: Any,
    environment: dict[str, str],
    output: CallerOutput,
) -> None:
    """One rank: the caller's environment and output (a forked rank has the fork server's, from
    its start) and torchrun's environment, then `fn`, its result or traceback sent home."""
    output.attach()
    os.environ.clear()
    os.environ.update(environment)
    torchrun_environment(rank, world, port)
    try:
        # plain pickle copies tensors by value (the queue's own pickler would share them by file
        # descriptor, which dies with this process)
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # report everything, including SystemExit
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """`fn(*args)` on `world_size` spawned ranks; their results in rank order, or one
    AssertionError naming what every failed rank did (raised, exited, or silent past `timeout`)."""
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    environment, output = dict(os.environ), CallerOutput()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, environment, output), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                break
            outcomes[rank] = (ok, value)
            if not ok:  # give the others a moment to report, then stop them
                try:
                    while len(outcomes) < world_size:
                        rank, ok, value = results.get(timeout=5)
                        outcomes[rank] = (ok, value)
                except queue.Empty:
                    pass
                break
    finally:
        for p in procs:
            p.join(timeout=1 if len(outcomes) < world_size else 30)
            if p.is_alive():
                p.kill()
    failures = []
    for rank in range(world_size):
        if rank not in outcomes:
            code = procs[rank].exitcode
            failures.append(
                f"rank {rank}: no result (exit code {code}; crashed, stopped or timed out after {timeout:.0f}s)"
            )
        elif not outcomes[rank][0]:
            failures.append(f"rank {rank} raised:\n{outcomes[rank][1]}")
    if failures:
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(failures))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
