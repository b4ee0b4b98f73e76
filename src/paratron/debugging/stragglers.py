"""Who is slow: --straggler-threshold's per-rank compute and collective-wait figures, and the line
that names the ranks the others wait for.

A straggler shows itself twice: its own step takes longer, and its peers spend that time waiting
for it inside a collective. So each rank measures its step time and, per process group, the time
it spends in collectives; its compute time is the difference. Every log interval the ranks swap
these figures (one small all-gather) and rank 0 names each rank whose compute time is more than
the threshold above the median, with the groups whose other members waited longest for it.

The instrument: while training runs, the functions paratron calls on `torch.distributed`
(all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, barrier, send/recv,
batch_isend_irecv and their object and single-tensor forms) are replaced by timed wrappers. A
blocking call is timed around itself; an asynchronous one (async_op=True, batch_isend_irecv)
returns its Work behind a proxy whose wait() is timed. isend and irecv stay torch's own: a
P2POp must name them (torch checks), and paratron posts them through batch_isend_irecv. Time is
charged to the call's group, named as the Topology names it ("dp group [0, 1]"; the default
group is "world"), and only while a training step runs on the thread that runs it. torch's own
internal calls (all_gather_object's all_gather) go to the original functions and are not counted
twice. On a device whose collectives run asynchronously (CUDA), the device is synchronized
before each blocking call and after each call and wait, so that the measured time is the
collective's and not queued compute; an asynchronous wait on such a device also counts compute
still queued when it began (an upper bound of the wait). These synchronizations happen only
while the detector is on.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paratron.distributed.init import synchronize
from paratron.distributed.topology import Axis, Topology

TIMED_CALLS = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "barrier",
    "send",
    "recv",
)
"""torch.distributed's functions that block unless called with async_op=True."""

MIN_EXCESS_S = 0.01
"""Seconds per step a rank must also be above the median to be named: a few milliseconds of scheduling
jitter on short steps is not a straggler."""

DELAYED_SHARE = 0.5
"""A straggler delays every group of its in which the other members waited at least this share of the
longest such wait."""


@dataclass
class RankFigures:
    """One rank's figures over a log interval: step time, and the time spent in collectives per group."""

    rank: int
    steps: int
    step_s: float
    waits: dict[str, float] = field(default_factory=dict)
    """Seconds in collectives, by group name."""
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The members of each group named in `waits`."""

    @property
    def wait_s(self) -> float:
        return sum(self.waits.values())

    @property
    def compute_s(self) -> float:
        """Step time not spent waiting in collectives."""
        return max(self.step_s - self.wait_s, 0.0)


@dataclass(frozen=True)
class Straggler:
    """A rank slower than the median by more than the threshold, and the groups it holds up."""

    rank: int
    compute_s: float
    median_s: float
    delays: tuple[tuple[str, float], ...]
    """(group name, the longest time another member waited in it), longest first."""

    @property
    def excess(self) -> float:
        """How far above the median, as a fraction of it."""
        return self.compute_s / self.median_s - 1 if self.median_s > 0 else float("inf")


def find_stragglers(figures: list[RankFigures], threshold: float) -> list[Straggler]:
    """The ranks whose compute time is more than `threshold` (a fraction) above the median rank's, and
    at least MIN_EXCESS_S per step above it. With an even count the lower middle value is the median,
    so that of two ranks the slower one is measured against the faster (the mean of the two would
    hide any straggler beyond 100%)."""
    if len(figures) < 2:
        return []
    median = statistics.median_low(f.compute_s for f in figures)
    slow = [
        f
        for f in figures
        if f.compute_s > median * (1 + threshold) and f.compute_s - median >= MIN_EXCESS_S * max(f.steps, 1)
    ]
    return [Straggler(f.rank, f.compute_s, median, delayed_groups(f, figures)) for f in slow]


def delayed_groups(slow: RankFigures, figures: list[RankFigures]) -> tuple[tuple[str, float], ...]:
    """The groups of `slow` in which its other members waited longest (at least DELAYED_SHARE of the
    longest such wait), with that wait, longest first."""
    by_rank = {f.rank: f for f in figures}
    waited = {}
    for name, members in slow.groups.items():
        others = [by_rank[r].waits.get(name, 0.0) for r in members if r != slow.rank and r in by_rank]
        if others and max(others) > 0:
            waited[name] = max(others)
    if not waited:
        return ()
    longest = max(waited.values())
    chosen = [(name, s) for name, s in waited.items() if s >= DELAYED_SHARE * longest]
    return tuple(sorted(chosen, key=lambda pair: -pair[1]))


def straggler_line(iteration: int, stragglers: list[Straggler], steps: int) -> str:
    """One line naming every straggler: its compute time per step against the median's, and whom it delays."""
    per_step = max(steps, 1)
    parts = []
    for s in stragglers:
        delays = ", ".join(f"{name} (its peers waited {wait / per_step:.3f} s/step)" for name, wait in s.delays)
        parts.append(
            f"rank {s.rank} computes {s.compute_s / per_step:.3f} s/step, {100 * s.excess:.0f}% above the median "
            f"{s.median_s / per_step:.3f} s/step; delays {delays or 'no group (no peer waited for it)'}"
        )
    return f"step {iteration}: stragglers: " + "; ".join(parts)


def straggler_metrics(figures: list[RankFigures], stragglers: list[Straggler]) -> dict[str, Any]:
    """metrics.jsonl's figures: every rank's compute and wait seconds per step, the ranks named and
    the groups each delays."""
    record: dict[str, Any] = {}
    for f in figures:
        per_step = max(f.steps, 1)
        record[f"straggler/rank{f.rank}/compute_s"] = f.compute_s / per_step
        record[f"straggler/rank{f.rank}/wait_s"] = f.wait_s / per_step
    record["straggler/ranks"] = [s.rank for s in stragglers]
    for s in stragglers:
        record[f"straggler/rank{s.rank}/delays"] = "; ".join(name for name, _ in s.delays)
    return record


def group_names(topology: Topology) -> dict[Any, tuple[str, tuple[int, ...]]]:
    """Every process group of the topology, by its torch object: its name as the Topology says it
    ("dp group [0, 1]"; the first kind of group in `Axis` order when several kinds share one) and its ranks."""
    names: dict[Any, tuple[str, tuple[int, ...]]] = {}
    for axis in Axis:
        try:
            group = topology.group(axis)
        except RuntimeError:  # (its groups were not created: not used)
            continue
        if group.process_group is not None and group.process_group not in names:
            names[group.process_group] = (f"{axis.value} group {list(group.ranks)}", group.ranks)
    return names


class StragglerDetector:
    """--straggler-threshold: times this rank's steps and its waits in collectives, and at each log
    line swaps the figures with every rank and names the stragglers. Does nothing when the threshold is unset."""

    def __init__(self, threshold: float | None, topology: Topology, device: torch.device) -> None:
        self.threshold, self.topology, self.device = threshold, topology, device
        self.enabled = threshold is not None and dist.is_initialized() and dist.get_world_size() > 1
        self.names: dict[Any, tuple[str, tuple[int, ...]]] = group_names(topology) if self.enabled else {}
        self.stepping_thread: int | None = None
        self._start_interval()

    def _start_interval(self) -> None:
        self.steps, self.step_s = 0, 0.0
        self.waits: dict[str, float] = {}
        self.groups: dict[str, tuple[int, ...]] = {}

    @contextlib.contextmanager
    def instrumented(self) -> Iterator[None]:
        """Within: torch.distributed's collectives are timed (when the detector is on)."""
        if not self.enabled:
            yield
            return
        with wrapped_collectives(self._charge, self._measuring, self.device):
            yield

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Around one training step: its time, and its waits in collectives."""
        if not self.enabled:
            yield
            return
        synchronize(self.device)
        self.stepping_thread = threading.get_ident()
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.step_s += time.perf_counter() - start
            self.steps += 1
            self.stepping_thread = None

    def _measuring(self) -> bool:
        return self.stepping_thread == threading.get_ident()

    def _charge(self, group: Any, seconds: float) -> None:
        name, ranks = self.group_name(group)
        self.waits[name] = self.waits.get(name, 0.0) + seconds
        self.groups[name] = ranks

    def group_name(self, group: Any) -> tuple[str, tuple[int, ...]]:
        """A process group's name and ranks (None: the default group, "world")."""
        if group is None or group is dist.group.WORLD:
            return "world", tuple(range(dist.get_world_size()))
        known = self.names.get(group)
        if known is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            known = self.names[group] = (f"group {list(ranks)}", ranks)
        return known

    def report(self, iteration: int, say: Callable[[str], None]) -> dict[str, Any]:
        """Collective: swap the interval's figures, `say` the stragglers (when any), return the metrics
        record's straggler entries and start a new interval. Nothing when the detector is off."""
        if not self.enabled or not self.steps:
            return {}
        mine = RankFigures(dist.get_rank(), self.steps, self.step_s, dict(self.waits), dict(self.groups))
        figures: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(figures, mine)
        stragglers = find_stragglers(figures, self.threshold or 0.0)
        if stragglers:
            say(straggler_line(iteration, stragglers, self.steps))
        self._start_interval()
        return straggler_metrics(figures, stragglers)


@contextlib.contextmanager
def wrapped_collectives(
    charge: Callable[[Any, float], None], measuring: Callable[[], bool], device: torch.device
) -> Iterator[None]:
    """Within: torch.distributed's collectives replaced by timed wrappers that `charge(group, seconds)`
    while `measuring()`; the originals are back afterwards."""
    originals = {name: getattr(dist, name) for name in TIMED_CALLS if hasattr(dist, name)}
    wrappers = {name: _timed(fn, charge, measuring, device) for name, fn in originals.items()}
    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    wrappers["batch_isend_irecv"] = _timed_batch(dist.batch_isend_irecv, charge, measuring, device)
    for name, wrapper in wrappers.items():
        setattr(dist, name, wrapper)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _timed(
    call: Callable, charge: Callable[[Any, float], None], measuring: Callable[[], bool], device: torch.device
) -> Callable:
    """`call` timed: blocking, around the call; with async_op, at its Work's wait()."""
    signature = inspect.signature(call)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not measuring():
            return call(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        group = bound.get("group")
        if bound.get("async_op", False):
            work = call(*args, **kwargs)
            return None if work is None else TimedWork(work, group, charge, device)
        synchronize(device)
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            synchronize(device)
            charge(group, time.perf_counter() - start)

    timed.__wrapped__ = call  # type: ignore[attr-defined]
    return timed


def _timed_batch(
    call: Callable, charge: Callable[[Any, float], None], measuring: Callable[[], bool], device: torch.device
) -> Callable:
    """batch_isend_irecv with every returned Work's wait() timed."""

    def timed(p2p_op_list: list[Any]) -> Any:
        works = call(p2p_op_list)
        if not measuring() or not works:
            return works
        group = p2p_op_list[0].group
        return [TimedWork(work, group, charge, device) for work in works]

    timed.__wrapped__ = call  # type: ignore[attr-defined]
    return timed


class TimedWork:
    """A collective's Work whose wait() is timed and charged to its group; anything else is the Work's."""

    def __init__(self, work: Any, group: Any, charge: Callable[[Any, float], None], device: torch.device) -> None:
        self._work, self._group, self._charge, self._device = work, group, charge, device

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            synchronize(self._device)
            self._charge(self._group, time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
