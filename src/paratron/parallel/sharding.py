"""What part of its single-device tensor a parameter holds, and what its gradient still needs.

Parallel layers tag their parameters:

- `param.shard`: a `Shard` when the parameter holds a slice of the single-device tensor of
  the same name (columns of a column-parallel weight, rows of a vocabulary shard...).
  Untagged parameters hold the whole tensor, replicated on every tensor-parallel rank.
- `param.partial_grad_group`: a process group over which this parameter's gradient must
  be summed before the optimizer sees it (norm weights under sequence parallelism, a
  key/value head replicated over several tensor-parallel ranks).

Initialization, checkpoints and gradient norms read these tags, so they work the same for
every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from paratron.distributed import comm


@dataclass(frozen=True)
class Shard:
    """This rank holds single-device indices [start, start + length) of dimension `dim`
    (of `full_size`) in the first `length` entries of its tensor; any further entries are
    padding. `duplicates` tensor-parallel ranks hold this same slice."""

    dim: int
    start: int
    length: int
    full_size: int
    duplicates: int = 1


def set_shard(param: torch.Tensor, layout: Sequence[Shard], rank: int) -> None:
    """Tag `param` with every tensor-parallel rank's slice (`layout`) and its own."""
    param.shard_layout = tuple(layout)  # type: ignore[attr-defined]
    param.shard = layout[rank]  # type: ignore[attr-defined]


def shard_of(param: torch.Tensor) -> Shard | None:
    return getattr(param, "shard", None)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of the single-device tensor this parameter is (a slice of)."""
    shard = shard_of(param)
    shape = list(param.shape)
    if shard is not None:
        shape[shard.dim] = shard.full_size
    return tuple(shape)


def take_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor (padding zeroed) from the single-device tensor."""
    shard = shard_of(param)
    if shard is None:
        return full
    local = torch.zeros_like(param)
    if shard.length:  # a rank may hold only padding (vocabulary rows beyond the real ones)
        local.narrow(shard.dim, 0, shard.length).copy_(full.narrow(shard.dim, shard.start, shard.length))
    return local


def gather_full(param: torch.Tensor, group: Any, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The single-device tensor, assembled from every tensor-parallel rank's slice (collective).
    `tensor` (default: the parameter itself) may be anything laid out like it, e.g. its gradient."""
    tensor = (param if tensor is None else tensor).detach()
    shard = shard_of(param)
    if shard is None or comm.group_size(group) == 1:
        return tensor
    size = comm.group_size(group)
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(pieces, tensor.contiguous(), group=group)
    full = tensor.new_empty(full_shape(param))
    for piece, s in zip(pieces, param.shard_layout):  # type: ignore[attr-defined]
        if s.length:
            full.narrow(s.dim, s.start, s.length).copy_(piece.narrow(s.dim, 0, s.length))
    return full


def set_partial_grad(param: torch.Tensor, group: Any) -> None:
    existing = getattr(param, "partial_grad_group", None)
    if existing is not None and existing is not group:
        raise ValueError("a parameter's gradient can be completed over one group only")
    param.partial_grad_group = group  # type: ignore[attr-defined]


def partial_grad_groups(params: Sequence[torch.Tensor]) -> list[tuple[Any, list[torch.Tensor]]]:
    """The parameters tagged with `partial_grad_group`, by group: (group, its parameters)."""
    groups: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p in params:
        group = getattr(p, "partial_grad_group", None)
        if group is not None:
            groups.setdefault(id(group), (group, []))[1].append(p)
    return list(groups.values())


def grad_norm_weight(param: torch.Tensor, tp_size: int) -> float:
    """Weight of this parameter's squared gradient norm in a sum over the model-parallel ranks
    (tensor x pipeline), so that a tensor held by several ranks counts once: replicas over the
    tensor-parallel group share the weight, and the last pipeline stage's copy of a tied
    embedding (`pipeline_duplicate`) counts zero."""
    if getattr(param, "pipeline_duplicate", False):
        return 0.0
    shard = shard_of(param)
    return 1.0 / (shard.duplicates if shard is not None else tp_size)
