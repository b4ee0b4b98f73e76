"""When to stop before --train-iters: a signal, a time budget or a step interval (Megatron-LM's
--exit-signal-handler, --exit-duration-in-mins and --exit-interval).

The loop asks after every step; every rank must give the same answer, so that all of them
save the same step and leave together. The interval is the same everywhere by construction;
a signal may reach only some ranks and clocks differ, so those two are agreed with one
all-reduce (MAX) over all ranks, made only when they are switched on.
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from paratron.config.schema import TrainingConfig

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitConditions:
    """Use as a context manager around the loop (it installs and restores the signal handlers),
    and call `reason(iteration)` after each step."""

    def __init__(self, config: TrainingConfig, device: torch.device, started: float | None = None) -> None:
        self.config, self.device = config, device
        self.started = time.monotonic() if started is None else started
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def __enter__(self) -> ExitConditions:
        if self.config.exit_signal_handler:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` (the same on every rank), or None to go on."""
        t = self.config
        agreed = 0
        if t.exit_signal_handler or t.exit_duration_in_mins is not None:
            local = 0
            if self.received is not None:
                local = 2
            elif (
                t.exit_duration_in_mins is not None and time.monotonic() - self.started >= 60 * t.exit_duration_in_mins
            ):
                local = 1
            flag = torch.tensor([local], device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = int(flag.item())
        if agreed == 2:
            name = signal.Signals(self.received).name if self.received is not None else "a signal"
            return f"{name} received (--exit-signal-handler)"
        if agreed == 1:
            return f"--exit-duration-in-mins {t.exit_duration_in_mins:g} reached"
        if t.exit_interval is not None and iteration % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        return None
