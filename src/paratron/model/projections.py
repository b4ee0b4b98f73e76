"""Several linear maps of one input kept as one module, so that tensor parallelism can split
them as one matrix (queries, keys and values; an MLP's gate and up projections)."""

from __future__ import annotations

import torch
from torch import nn


class Projections(nn.ModuleDict):
    """Several linear maps of the same input, returned as a tuple in order (queries, keys and
    values; or gate and up). Kept together so parallelism can treat them as one matrix."""

    def __init__(self, in_features: int, out_features: dict[str, int], bias: bool) -> None:
        super().__init__({name: nn.Linear(in_features, size, bias=bias) for name, size in out_features.items()})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(linear(x) for linear in self.values())
