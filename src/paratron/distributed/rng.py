"""Named random-generator states, for dropout inside tensor-parallel regions.

Outside tensor-parallel regions every TP rank holds the same activations and must draw
the same dropout masks: the default generator, seeded alike on all TP ranks. Inside them
(attention probabilities of this rank's heads, activations split along the sequence) each
rank's masks must differ yet stay reproducible: those draws run under `fork("tensor-parallel")`,
a generator seeded with seed + 2718 + tp_rank (Megatron-LM's offset). Works on any device.

Switching generator states cannot be traced by `torch.compile`, so a fork would break a compiled
block's graph. Three things keep it out: a `Forked` module whose wrapped module draws nothing (no
dropout, or p = 0) runs without switching (the states would not change); a compiled block whose
every draw runs under the same fork (sequence parallelism) switches once around the compiled call
(`fork_outside`), outside its graph, in the order eager draws in; and where such a block also has
plain dropout outside the fork (tensor parallelism without sequence parallelism), that dropout
becomes a `DropoutOutsideFork`, an operator opaque to the compiler that draws its mask from the
state outside the fork, as eager would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

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


_OUTSIDE: list[torch.Tensor] = []
"""The default generator's states outside the forks now entered, innermost last (like the generator, one per
process)."""


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
        _OUTSIDE.append(_get_state(self.device))
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(_OUTSIDE.pop(), self.device)


@contextlib.contextmanager
def outside_fork(device: torch.device) -> Iterator[None]:
    """Inside a fork: the default generator back in its state outside the fork (which it then advances)."""
    inside = _get_state(device)
    _set_state(_OUTSIDE[-1], device)
    try:
        yield
    finally:
        _OUTSIDE[-1] = _get_state(device)
        _set_state(inside, device)


@torch.library.custom_op("paratron::dropout_outside_fork", mutates_args=())
def _dropout_outside_fork(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, mask) of dropout with the mask drawn outside the fork entered (eager's draw: the same mask)."""
    with outside_fork(x.device):
        return torch.native_dropout(x, p, True)


@_dropout_outside_fork.register_fake
def _(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _keep_mask(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[1])
    ctx.scale = 1.0 / (1.0 - inputs[1])


def _dropout_gradient(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, None]:
    (mask,) = ctx.saved_tensors
    return torch.ops.aten.native_dropout_backward(grad, mask, ctx.scale), None


_dropout_outside_fork.register_autograd(_dropout_gradient, setup_context=_keep_mask)
torch.fx.node.has_side_effect(torch.ops.paratron.dropout_outside_fork.default)  # (it draws: never merged or dropped)


class DropoutOutsideFork(nn.Dropout):
    """A dropout inside a block that runs under a fork (`fork_outside`) whose masks must not come from it:
    drawn by `_dropout_outside_fork`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return torch.ops.paratron.dropout_outside_fork(x, self.p)[0]


def draws(module: nn.Module) -> bool:
    """Whether `module` itself may draw random numbers when training: a dropout with p > 0, or a
    module with a positive `dropout` probability (the attention core's)."""
    if isinstance(module, _DropoutNd):
        return module.p > 0
    rate = getattr(module, "dropout", None)
    return isinstance(rate, float) and rate > 0


class Forked(nn.Module):
    """Runs the wrapped module with a named generator state (its dropout masks come from it)."""

    def __init__(self, module: nn.Module, rng: RNGStates, name: str = TENSOR_PARALLEL) -> None:
        super().__init__()
        self.module, self.rng, self.name = module, rng, name
        self.switches = True
        """False when the caller already runs under this fork (see `fork_outside`)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.switches or not any(draws(m) for m in self.module.modules()):
            return self.module(*args, **kwargs)
        with self.rng.fork(self.name):
            return self.module(*args, **kwargs)


def _draws(block: nn.Module) -> tuple[list[tuple[RNGStates, str]], list[nn.Module], list[nn.Module]]:
    """`block`'s forks (generator states, name; each once), its drawing modules, and those of them outside
    every fork."""
    forked = [m for m in block.modules() if isinstance(m, Forked)]
    forks = list({(id(m.rng), m.name): (m.rng, m.name) for m in forked}.values())
    inside = {id(d) for m in forked for d in m.module.modules()}
    drawing = [m for m in block.modules() if draws(m)]
    return forks, drawing, [m for m in drawing if id(m) not in inside]


def single_fork(block: nn.Module) -> tuple[RNGStates, str] | None:
    """The one fork (generator states, name) under which every drawing module of `block` runs, or
    None: when the block draws nothing, when something draws outside a fork, or under two forks."""
    forks, drawing, outside = _draws(block)
    return forks[0] if len(forks) == 1 and drawing and not outside else None


def fork_outside(block: nn.Module, call: Any) -> Any:
    """`call` (the block's compiled call) run under the block's one fork, switched here rather than by its
    `Forked` modules; plain dropouts outside the fork draw outside it (`DropoutOutsideFork`). `call`
    itself when nothing draws under a fork, under two of them, or outside them by other means than dropout."""
    forks, drawing, outside = _draws(block)
    if len(forks) != 1 or len(outside) == len(drawing) or any(type(m) is not nn.Dropout for m in outside):
        return call
    rng, name = forks[0]
    swapped = {id(m) for m in outside}
    for parent in list(block.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in swapped:
                setattr(parent, child_name, DropoutOutsideFork(child.p))
    for module in block.modules():
        if isinstance(module, Forked):
            module.switches = False

    def forked_call(*args: Any, **kwargs: Any) -> Any:
        with rng.fork(name):
            return call(*args, **kwargs)

    return forked_call
