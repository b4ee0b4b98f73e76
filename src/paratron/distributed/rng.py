"""Named random-generator states, for dropout inside tensor-parallel regions.

Outside tensor-parallel regions every TP rank holds the same activations and must draw
the same dropout masks: the default generator, seeded alike on all TP ranks. Inside them
(attention probabilities of this rank's heads, activations split along the sequence) each
rank's masks must differ yet stay reproducible: those draws run under `fork("tensor-parallel")`,
a generator seeded with seed + 2718 + tp_rank (Megatron-LM's offset). Works on any device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

TENSOR_PARALLEL = "tensor-parallel"
TENSOR_PARALLEL_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def capture(device: torch.device) -> dict[str, torch.Tensor]:
    """The default generators' states: the CPU's and, on an accelerator, this device's."""
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = _get_state(device)
    return state


def restore(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state and device.type != "cpu":
        _set_state(state["device"], device)


class RNGStates:
    """Generator states by name, swapped in and out of the default generator of `device`."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        # (a model built on the meta device, as `paratron train --dry-run` does, draws nothing: the
        # stream is seeded on the CPU, whose generator every build has)
        device = "cpu" if self.device.type == "meta" else self.device
        self.states[name] = torch.Generator(device=device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        outside = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(outside, self.device)


class Forked(nn.Module):
    """Runs the wrapped module with a named generator state (its dropout masks come from it)."""

    def __init__(self, module: nn.Module, rng: RNGStates, name: str = TENSOR_PARALLEL) -> None:
        super().__init__()
        self.module, self.rng, self.name = module, rng, name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.rng.fork(self.name):
            return self.module(*args, **kwargs)
