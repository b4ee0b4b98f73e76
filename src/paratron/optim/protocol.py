"""The one protocol every optimizer of a training step follows, whatever the ZeRO stage.

`training.step.train_step` calls, in order:

    prepare_grads()    take the step's synchronized gradients as the tensors `step` will use
                       (fp32 main gradients, or this rank's shard of them)
    grads_for_norm()   those tensors, each one's weight in the global norm, and the group the
                       squared norms are summed over (unscaling and clipping act on them in place)
    step()             update the fp32 master weights (or this rank's pieces of them)
    after_step()       publish the update to the model: copy into 16-bit weights, gather the
                       shards of the distributed optimizer

and never looks inside. Checkpoints read `pieces()`: what is stepped, piece by piece, with the
part of its parameter each piece is, so optimizer state saves and loads at any layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from paratron.distributed.topology import RankGroup


@dataclass
class GradsForNorm:
    """The gradients this rank holds, for the global norm and for unscaling."""

    tensors: list[torch.Tensor]
    weights: torch.Tensor | None
    """Each tensor's weight in the sum of squares (None: all 1), so that a tensor held by several
    ranks counts once (see `parallel.sharding.grad_norm_weight`)."""
    group: RankGroup
    """The ranks over which the squared norms are summed (and overflows agreed on)."""


@dataclass
class OptimizerPiece:
    """One tensor the optimizer steps: elements [start, end) of the flattened (tensor-parallel
    local) `param`."""

    param: nn.Parameter
    start: int
    end: int
    master: torch.Tensor
    """The tensor stepped (its state in `optimizer.state` is keyed by it)."""
    copy: bool
    """`master` is an fp32 copy of 16-bit weights; otherwise it is the weights themselves."""


class TrainingOptimizer(Protocol):
    """See the module docstring. `optimizer` is the PyTorch optimizer over the master tensors."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> Any: ...

    def prepare_grads(self) -> None: ...

    def grads_for_norm(self) -> GradsForNorm: ...

    def step(self) -> None: ...

    def after_step(self) -> None: ...

    def write_back(self) -> None: ...

    def pieces(self) -> list[OptimizerPiece]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
