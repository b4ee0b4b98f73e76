"""What runs around each step to look inside it or keep it steady: the PyTorch profiler (--profile),
per-step timers (--timing-log-level) and manual garbage collection (--manual-gc).

The profiler records steps [--profile-step-start, --profile-step-end) on the --profile-ranks, CPU
activity always and CUDA activity when the run is on a CUDA device, each step marked by a
`ProfilerStep#N` range, and writes one Chrome trace per rank into the TensorBoard directory. The
profiled steps open with a barrier of every rank (marked in the traces, to align them by), and
close with rank 0 merging the traces of two or more profiled ranks into one timeline
(`debugging/trace.py`), those it cannot see on its own disk sent over the default group.

Timers are wall-clock (`time.perf_counter`) around parts of the step, with the device
synchronized at each boundary so that queued kernels are charged to the part that queued them
(on the CPU, where work is not queued, the synchronization is free). They add a sync per part and
so are off (level 0: the iteration time only) unless asked for.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from paratron.config.fields import flag
from paratron.config.schema import LoggingConfig, TrainingConfig
from paratron.debugging.trace import SYNC_MARK, TraceError, read_trace, write_merged
from paratron.distributed.init import synchronize
from paratron.errors import ConfigError
from paratron.storage import replacing

TIMERS_BY_LEVEL = {
    1: (
        "forward-backward",
        "all-grads-sync",
        "optimizer-unscale-and-check-inf",
        "optimizer-clip-main-grad",
        "optimizer-count-zeros",
        "optimizer-inner-step",
        "optimizer-copy-main-to-model-params",
        "optimizer",
    ),
    2: ("batch-generator",),
}
"""Megatron-LM's timer names that paratron measures, by --timing-log-level. forward-backward includes
the gradient reduction that overlaps it; all-grads-sync is what is left of it afterwards (taking
the reduced gradients as the optimizer's main gradients)."""


def timer_names(level: int) -> tuple[str, ...]:
    return tuple(name for lvl, names in TIMERS_BY_LEVEL.items() if lvl <= level for name in names)


@dataclass
class StepTimers:
    """Seconds spent in each named part of the steps since the last log line (this rank's)."""

    level: int
    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.names = timer_names(self.level)
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.names, 0.0)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Add the time spent in the block to `name` (nothing when the level does not include it)."""
        if name not in self.seconds:
            yield
            return
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start

    def report(self, steps: int, option: str) -> dict[str, float | list[float]]:
        """Seconds per step of each timer over all ranks (collective when distributed), as
        NAME-time: the max over ranks (and NAME-time-min with minmax), or every rank's (all)."""
        if not self.names:
            return {}
        mine = torch.tensor([self.seconds[n] / max(steps, 1) for n in self.names], dtype=torch.float64)
        ranks = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather_object(ranks, mine)  # (objects: the CPU tensors travel under any backend)
        table = torch.stack(ranks)  # [ranks, timers]
        out: dict[str, float | list[float]] = {}
        for i, name in enumerate(self.names):
            column = table[:, i]
            if option == "all":
                out[f"{name}-time"] = [float(v) for v in column]
                continue
            if option == "minmax":
                out[f"{name}-time-min"] = float(column.min())
            out[f"{name}-time"] = float(column.max())
        return out


class StepProfiler:
    """--profile: a torch.profiler trace of steps [start, end) on the chosen ranks."""

    def __init__(self, logging: LoggingConfig, rank: int, device: torch.device, folder: Path) -> None:
        self.start, self.end = logging.profile_step_start, logging.profile_step_end
        self.enabled = logging.profile and rank in profile_ranks(logging)
        self.rank, self.device = rank, device
        self.path = folder / f"profile_rank{rank}_steps{self.start}-{self.end}.pt.trace.json"
        self.merged_path = folder / f"profile_merged_steps{self.start}-{self.end}.json"
        self.merged: Path | None = None
        """The merged trace of every profiled rank, once rank 0 has written it."""
        self._profiling = logging.profile
        self._recording = False  # (every rank: the profiled steps have begun and are not merged yet)
        self._profiler: torch.profiler.profile | None = None
        self._step_range: contextlib.AbstractContextManager | None = None

    def begin(self, iteration: int) -> None:
        """Before step `iteration`: start recording at the first profiled step (every rank leaving a
        barrier together, marked in the traces), mark the step."""
        if not self._profiling or not self.start <= iteration < self.end:
            return
        if not self._recording:
            self._recording = True
            if self.enabled:
                activities = [torch.profiler.ProfilerActivity.CPU]
                device_activity = getattr(torch.profiler.ProfilerActivity, self.device.type.upper(), None)
                if self.device.type != "cpu" and device_activity is not None:  # (CUDA, XPU kernels)
                    activities.append(device_activity)
                self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
                self._profiler.__enter__()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
            if self.enabled:
                with torch.profiler.record_function(SYNC_MARK):
                    pass
        if not self.enabled:
            return
        self._step_range = torch.profiler.record_function(f"ProfilerStep#{iteration}")
        self._step_range.__enter__()

    def finish_step(self, iteration: int) -> Path | None:
        """After step `iteration`: close its mark; after the last profiled step stop and write the
        trace (its path; None otherwise). Steps after the last one (a run that stops early) end it."""
        if self._step_range is not None:
            synchronize(self.device)
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if not self._recording or iteration < self.end - 1:
            return None
        return self.close()

    def close(self) -> Path | None:
        """Stop recording, write this rank's trace (its path, None on a rank not profiled) and merge
        every rank's (collective: every rank calls it at the same step)."""
        if not self._recording:
            return None
        self._recording = False
        written = None
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with replacing(self.path) as tmp:
                profiler.export_chrome_trace(str(tmp))
            written = self.path
        traces = gather_traces(written)
        if len(traces) > 1:  # (one rank's trace is its own timeline already)
            try:
                self.merged = write_merged(traces, self.merged_path)
                print(f"profile of every rank, merged into one timeline: {self.merged}")
            except TraceError as exc:
                print(f"rank {self.rank}: the ranks' profiles were not merged: {exc}")
        return written


def gather_traces(written: Path | None) -> dict[int, dict]:
    """On rank 0, every rank's trace (rank -> parsed JSON), read from the path each rank wrote or,
    where rank 0 does not see that path (no shared disk), sent over the default group; {} elsewhere.
    Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {0: read_trace(written)} if written is not None else {}
    rank, world = dist.get_rank(), dist.get_world_size()
    paths: list[str | None] = [None] * world
    dist.all_gather_object(paths, None if written is None else str(written))
    unseen = [[r for r, p in enumerate(paths) if p is not None and not Path(p).is_file()] if rank == 0 else None]
    dist.broadcast_object_list(unseen, src=0)
    text = written.read_text() if written is not None and rank in unseen[0] else None
    texts: list[str | None] | None = [None] * world if rank == 0 else None
    dist.gather_object(text, texts, dst=0)
    if rank != 0 or texts is None:
        return {}
    traces = {r: read_trace(Path(p)) for r, p in enumerate(paths) if p is not None and r not in unseen[0]}
    traces.update({r: json.loads(t) for r, t in enumerate(texts) if t is not None})
    return traces


def profile_ranks(logging: LoggingConfig) -> set[int]:
    """--profile-ranks as numbers (one-line error for anything else)."""
    return set(logging.profile_ranks)


def check_profile_settings(logging: LoggingConfig) -> None:
    """--profile's steps must make a non-empty range of real steps."""
    profile_ranks(logging)
    if logging.profile and not 1 <= logging.profile_step_start < logging.profile_step_end:
        raise ConfigError(
            f"{flag.profile_step_start} {logging.profile_step_start} {flag.profile_step_end} "
            f"{logging.profile_step_end}: profiling needs 1 <= start < end; e.g. {flag.profile_step_start} 2 "
            f"{flag.profile_step_end} 4"
        )


@contextlib.contextmanager
def manual_gc(training: TrainingConfig) -> Iterator[None]:
    """--manual-gc for the duration of training: the automatic collector off (one collection to
    start clean), back on afterwards as it was."""
    if not training.manual_gc:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def collect_after_step(training: TrainingConfig, iteration: int) -> None:
    """--manual-gc-interval: collect after every that many steps (every rank at the same step)."""
    if training.manual_gc and training.manual_gc_interval > 0 and iteration % training.manual_gc_interval == 0:
        gc.collect()


def collect_around_eval(training: TrainingConfig) -> None:
    """--manual-gc with evaluations collected (not --no-manual-gc-eval)."""
    if training.manual_gc and training.manual_gc_eval:
        gc.collect()
