"""Injected faults (`--fault-inject RANK:STEP:KIND`), for fault-tolerance tests and users' drills.

One fault per attempt of the job: the first given fires in the first run, the second after the
first restart (`--max-restarts`), and so on, so a drill with k faults restarts k times however
far back each restart resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paratron.config.faults import Fault, parse_faults
from paratron.config.fields import flag
from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.errors import ConfigError

SLOW_SECONDS = 2.0
SPIKE_SCALE = 30.0
"""A spike fault multiplies the step's logits by this (the loss jumps; its gradients with it)."""


def fault_of_attempt(specs: list[str], attempt: int, rank: int | None = None) -> Fault | None:
    """The fault of this attempt (restart count), if any; with `rank`, only if it is that rank's."""
    faults = parse_faults(specs)
    fault = faults[attempt] if attempt < len(faults) else None
    return fault if fault is not None and rank in (None, fault.rank) else None


@contextlib.contextmanager
def injected(fault: Fault | None, step: int, module: nn.Module) -> Iterator[None]:
    """Around one training step: fire `fault` if this is its step. crash and hang happen before
    the step, slow sleeps before it, nan makes the forward output of the first layer with weights
    that runs NaN during it, spike scales the logits by SPIKE_SCALE during it."""
    if fault is None or fault.step != step:
        yield
        return
    if fault.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        while True:  # stops answering: its peers' collectives time out, or the agent stops it
            time.sleep(3600)
    if fault.kind == "slow":
        time.sleep(SLOW_SECONDS)
    handles = []
    if fault.kind == "nan":
        handles = _poison_first_called(module, float("nan"))
    elif fault.kind == "spike":  # (its rank computes logits: `check_spike_fault`)
        handles = [module.output.register_forward_hook(_scaled(SPIKE_SCALE))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _scaled(factor: float) -> Any:
    """A forward hook that multiplies a layer's output (its first tensor) by `factor`."""

    def scale(layer: nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] * factor, *output[1:])
        return output * factor

    return scale


def _poison_first_called(module: nn.Module, factor: float) -> list[Any]:
    """Forward hooks on every layer with weights of `module`: the first one to run (the embedding
    on the first pipeline stage) has its output, its first tensor, multiplied by `factor` from then on."""
    chosen: list[nn.Module] = []
    scale = _scaled(factor)

    def poison(layer: nn.Module, inputs: Any, output: Any) -> Any:
        if not chosen:
            chosen.append(layer)
        return scale(layer, inputs, output) if layer is chosen[0] else None

    leaves = [m for m in module.modules() if not any(m.children()) and any(True for _ in m.parameters(False))]
    return [leaf.register_forward_hook(poison) for leaf in leaves]


def check_spike_fault(specs: list[str], attempt: int, rank: int, module: nn.Module, world: RankGroup) -> None:
    """A spike fault scales logits, which only the ranks holding the output layer compute: ConfigError, the same
    one line on every rank (one all-reduce over `world`), when this attempt's names a rank without it (a pipeline
    stage before the last); nothing to do for other faults."""
    fault = fault_of_attempt(specs, attempt)
    if fault is None or fault.kind != "spike":
        return
    device = next(module.parameters()).device
    missing = torch.tensor(float(fault.rank == rank and getattr(module, "output", None) is None), device=device)
    comm.all_reduce(missing, world)
    if missing.item():
        raise ConfigError(
            f"{flag.fault_inject} {fault.rank}:{fault.step}:spike: rank {fault.rank} computes no logits (its pipeline "
            "stage is not the last); name a rank of the last pipeline stage"
        )


class AttemptFault:
    """This rank's fault in this attempt, which fires once: a rollback (--on-nan) that passes its
    step again does not fire it again."""

    def __init__(self, specs: list[str], attempt: int, rank: int) -> None:
        self.fault = fault_of_attempt(specs, attempt, rank)

    @contextlib.contextmanager
    def at(self, step: int, module: nn.Module) -> Iterator[None]:
        """Around training step `step`: `injected`, the first time the step comes."""
        fault = self.fault
        if fault is not None and fault.step == step:
            self.fault = None
        with injected(fault, step, module):
            yield
