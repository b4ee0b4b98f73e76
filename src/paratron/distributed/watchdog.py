"""Hangs end with a report, not silence.

A thread per rank watches the training loop's progress (`Watchdog.progress`, a timestamp set at
the start and end of each step and save: no communication on the hot path). When the loop has
not moved for --distributed-timeout-minutes, the thread looks at where the main thread is stuck
(its Python stack: the torch.distributed call, or the paratron line waiting on an asynchronous
one, and the `RankGroup` or process group in reach of that frame), publishes that to the job's
store, waits a moment for the other ranks' own reports, and prints one line: the operation, the
group and its ranks, and which of them did not arrive (stuck elsewhere, or silent: dead or
unreachable). Then it ends the process with exit code 1, so the launcher stops the job (or
restarts it, with --max-restarts). The process group's own timeout is set later than the
watchdog's, so the report comes first.

The same thread ends a worker whose launcher is gone (its parent changed: it was adopted), where
the system sends no signal for that (on Linux the kernel does: `launch.end_with_launcher`).
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch.distributed as dist

from paratron.distributed.topology import RankGroup

PARENT_POLL_S = 0.1
"""How often a launched worker checks that its launcher still runs (cheap: one getppid)."""
REPORT_KEY = "paratron/hang/{rank}"
SPOKE_KEY = "paratron/hang-reported/{rank}"
ANSWER_WAIT_S = 5.0
"""How long a rank that timed out waits for the others' reports before it speaks."""


_REPORTED = threading.Event()


def hang_reported() -> bool:
    """Whether this process's watchdog has reported a hang (and is about to end it)."""
    return _REPORTED.is_set()


@dataclass(frozen=True)
class Position:
    """Where a rank's main thread is: the call, its place in paratron, and the group involved."""

    operation: str
    where: str
    group: str | None = None
    ranks: tuple[int, ...] | None = None

    @property
    def collective(self) -> bool:
        return self.group is not None


def position(frame: FrameType | None) -> Position:
    """Read a stack from its innermost frame: the innermost torch.distributed function (else the
    paratron function), the innermost paratron line, the nearest group in reach."""
    operation = where = None
    group: tuple[str, tuple[int, ...]] | None = None
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if operation is None and f"torch{os.sep}distributed" in path:
            operation = name
        if where is None and f"{os.sep}paratron{os.sep}" in path:
            line = linecache.getline(path, frame.f_lineno).strip()
            where = f"{_short(path)}:{frame.f_lineno} {name} ({line})"
            operation = operation or line  # (an asynchronous collective's wait has no Python frame of torch's)
        if group is None and where is not None:
            group = _group_in(frame.f_locals)
        frame = frame.f_back
    if group is None:
        return Position(operation or "?", where or "outside paratron")
    return Position(operation or "?", where or "outside paratron", group[0], group[1])


def _short(path: str) -> str:
    return path.split(f"{os.sep}paratron{os.sep}", 1)[-1]


def _group_in(names: dict[str, Any]) -> tuple[str, tuple[int, ...]] | None:
    """A RankGroup (or a torch process group) among a frame's locals or their attributes."""
    candidates = list(names.values())
    candidates += [getattr(v, attr, None) for v in names.values() for attr in ("group", "process_group")]
    for value in candidates:
        if isinstance(value, RankGroup) and value.size > 1:
            return value.name, value.ranks
        if isinstance(value, dist.ProcessGroup):
            try:
                return f"process group {value.group_name}", tuple(dist.get_process_group_ranks(value))
            except (RuntimeError, ValueError):
                continue
    return None


class Watchdog:
    """One per training process; `progress()` from the loop, the rest runs on its own thread."""

    def __init__(self, timeout_s: float, rank: int, world: int, store: Any | None, parent: int | None = None) -> None:
        self.timeout_s, self.rank, self.world, self.store = timeout_s, rank, world, store
        self.parent = parent
        """The launcher's pid this worker started under (None: not watched)."""
        self.main = threading.main_thread()
        self.last = time.monotonic()
        self.step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="paratron-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self.last = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def progress(self, step: int | None = None) -> None:
        """The loop moved (a step or a save began or ended)."""
        self.last = time.monotonic()
        if step is not None:
            self.step = step

    def _watch(self) -> None:
        # a worker watching its launcher looks often (the kernel's parent-death signal can miss: it follows the
        # launcher thread that started the worker, not the process), else as often as the timeout needs
        poll = PARENT_POLL_S if self.parent is not None else min(5.0, max(0.2, self.timeout_s / 10))
        while True:
            if self.parent is not None and os.getppid() != self.parent:  # (adopted: the launcher is gone)
                print(f"[rank {self.rank}] stopped: its launcher (pid {self.parent}) is gone", file=sys.stderr)
                os._exit(1)
            if self._stop.wait(poll):
                return
            if time.monotonic() - self.last > self.timeout_s:
                self._report_and_exit()

    def _report_and_exit(self) -> None:
        _REPORTED.set()
        mine = position(sys._current_frames().get(self.main.ident))
        others = self._exchange(mine)
        print(self.describe(mine, others), file=sys.stderr, flush=True)
        self._let_the_others_speak([r for r, p in others.items() if p is not None])
        os._exit(1)

    def _let_the_others_speak(self, answering: list[int]) -> None:
        """Wait (briefly) so that every rank that answered prints its line: the first process to exit
        makes the launcher stop the rest. Rank 0, whose process holds the store, waits for the
        others' word that they printed; they wait for its, then go."""
        if self.store is None:
            return
        try:
            self.store.set(SPOKE_KEY.format(rank=self.rank), "1")
            waiting_for = [r for r in answering if r != 0] if self.rank == 0 else [0] if 0 in answering else []
            deadline = time.monotonic() + ANSWER_WAIT_S
            while time.monotonic() < deadline:
                if all(self.store.check([SPOKE_KEY.format(rank=r)]) for r in waiting_for):
                    return
                time.sleep(0.05)
        except Exception:  # (the store went with its host)
            return

    def _exchange(self, mine: Position) -> dict[int, Position | None]:
        """Publish this rank's position; the others' (None: no report within ANSWER_WAIT_S)."""
        if self.store is None:
            return {}
        try:
            self.store.set(REPORT_KEY.format(rank=self.rank), json.dumps(mine.__dict__))
        except Exception:  # (the store lives on rank 0's node: it may be what died)
            return {}
        deadline, seen = time.monotonic() + ANSWER_WAIT_S, {}
        while time.monotonic() < deadline and len(seen) < self.world - 1:
            for rank in range(self.world):
                if rank == self.rank or rank in seen:
                    continue
                try:
                    if self.store.check([REPORT_KEY.format(rank=rank)]):
                        value = json.loads(self.store.get(REPORT_KEY.format(rank=rank)))
                        seen[rank] = Position(**{**value, "ranks": tuple(value["ranks"] or ()) or None})
                except Exception:
                    return {r: seen.get(r) for r in range(self.world) if r != self.rank}
            time.sleep(0.1)
        return {r: seen.get(r) for r in range(self.world) if r != self.rank}

    def describe(self, mine: Position, others: dict[int, Position | None]) -> str:
        """The one line a rank prints."""
        minutes = self.timeout_s / 60
        step = f"step {self.step}: " if self.step is not None else ""
        head = f"[rank {self.rank}] {step}no progress in {minutes:g} min (--distributed-timeout-minutes)"
        if not mine.collective:
            return f"{head}; this rank is not in a collective: at {mine.where}"
        members = [r for r in (mine.ranks or ()) if r != self.rank]
        missing = []
        for rank in members:
            other = others.get(rank)
            if other is None:
                missing.append(f"{rank} (no answer: dead or unreachable)")
            elif (other.operation, other.group) != (mine.operation, mine.group):
                missing.append(f"{rank} (at {other.where})")
        late = "; did not arrive: " + ", ".join(missing) if missing else "; every member is in it too"
        return (
            f"{head}; waiting in {mine.operation} over the {mine.group} group (ranks {list(mine.ranks or ())}) "
            f"at {mine.where}{late}"
        )
