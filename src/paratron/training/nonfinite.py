"""Which module went non-finite first: after a step whose gradients were NaN or infinite, the
step's forward and backward run again with a check on every module's output and on the gradient
of every output, and each rank reports the first it saw (forward in call order, then backward in
backward order); the earliest pipeline stage's report wins. The checks cost a device sync each,
so they run only for that one diagnostic pass, never in normal steps. A forward report beats a
gradient report (the backward pass only carries a NaN the forward made), and among gradients
the latest stage's wins (the backward pass runs from the last stage to the first)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@contextlib.contextmanager
def watching(module: nn.Module) -> Iterator[list[str]]:
    """Hooks on every submodule of `module` for as long as the context lasts; the list it yields
    gets (0, "the forward output of NAME") or (1, "the gradient of NAME's output") for the first
    non-finite tensor seen."""
    found: list[tuple[int, str]] = []
    handles = [sub.register_forward_hook(_checker(name or "model", found)) for name, sub in module.named_modules()]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def _checker(name: str, found: list[tuple[int, str]]) -> Callable[..., None]:
    def check(module: nn.Module, inputs: Any, output: Any) -> None:
        tensor = output[0] if isinstance(output, tuple) else output
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            return
        if not found and not bool(torch.isfinite(tensor).all()):
            found.append((0, f"the forward output of {name}"))
        if tensor.requires_grad:
            tensor.register_hook(lambda grad: _check_grad(grad, name, found))

    return check


def _check_grad(grad: torch.Tensor, name: str, found: list[tuple[int, str]]) -> None:
    if not found and not bool(torch.isfinite(grad).all()):
        found.append((1, f"the gradient of {name}'s output"))


def first_report(found: list[tuple[int, str]], stage: int, rank: int) -> str:
    """Over all ranks (collective): the forward report of the earliest pipeline stage, else the
    gradient report of the latest one (lowest rank on ties)."""
    mine = None
    if found:
        kind, what = found[0]
        mine = (kind, stage if kind == 0 else -stage, rank, what, stage)
    everyone: list[Any] = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    reports = sorted(r for r in everyone if r is not None)
    if not reports:
        return "no module's output or gradient was (the loss weights or the optimizer's input)"
    _, _, rank, what, stage = reports[0]
    return f"{what} on rank {rank} (pipeline stage {stage})"
