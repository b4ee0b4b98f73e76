"""A parameter's parallel facts, in one record: what part of its single-device tensor it holds,
and what its gradient still needs.

The transforms that create parallel parameters (tensor parallelism, the pipeline stage split,
zero-bubble deferral) describe each one in a `ParamInfo`, kept on the parameter as its only
tag. Initialization, checkpoints, gradient reduction and gradient norms read it, so they work
the same for every layout; code that re-creates parameters (materializing from the meta
device, FSDP2's sharding) copies this one record (`copy_info`).

    shard              a `Shard` when the parameter holds a slice of the single-device tensor of
                       the same name (columns of a column-parallel weight, rows of a vocabulary
                       shard, ...); None when it holds the whole tensor
    layout             every tensor-parallel rank's `Shard` of it (to assemble the whole tensor)
    partial_grad_group a group over which the gradient must be summed before the optimizer sees
                       it (norm weights under sequence parallelism, a key/value head replicated
                       over several tensor-parallel ranks, a tied embedding on two pipeline stages)
    pipeline_duplicate the last pipeline stage's copy of a tied embedding: it exists twice, so
                       checkpoints and gradient norms count the first stage's only
    deferred_grad      zero-bubble pipelines compute this weight's gradient in a separate W
                       operation, not in autograd's backward

A parameter's gradient is reduced over the data-parallel group; expert parameters (reduced
over the expert-data-parallel group) and context parallelism (data x context) will add that
choice here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratron.distributed.topology import RankGroup

_ATTRIBUTE = "_paratron_info"


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


@dataclass(frozen=True)
class ParamInfo:
    """The parallel facts of one parameter (see the module docstring)."""

    shard: Shard | None = None
    layout: tuple[Shard, ...] | None = None
    partial_grad_group: RankGroup | None = None
    pipeline_duplicate: bool = False
    deferred_grad: bool = False


def param_info(param: torch.Tensor) -> ParamInfo:
    """The parameter's record (the default one, a whole replicated tensor, when none was set)."""
    return getattr(param, _ATTRIBUTE, ParamInfo())


def update_info(param: torch.Tensor, **changes: object) -> None:
    setattr(param, _ATTRIBUTE, dataclasses.replace(param_info(param), **changes))


def copy_info(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give a re-created parameter the record of the one it replaces."""
    if hasattr(source, _ATTRIBUTE):
        setattr(target, _ATTRIBUTE, getattr(source, _ATTRIBUTE))


def set_shard(param: torch.Tensor, layout: Sequence[Shard], rank: int) -> None:
    """Record every tensor-parallel rank's slice (`layout`) and this rank's own."""
    update_info(param, layout=tuple(layout), shard=layout[rank])


def shard_of(param: torch.Tensor) -> Shard | None:
    return param_info(param).shard


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


def gather_full(param: torch.Tensor, group: RankGroup, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The single-device tensor, assembled from every tensor-parallel rank's slice (collective).
    `tensor` (default: the parameter itself) may be anything laid out like it, e.g. its gradient."""
    tensor = (param if tensor is None else tensor).detach()
    record = param_info(param)
    if record.shard is None or group.size == 1:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group.process_group)
    full = tensor.new_empty(full_shape(param))
    for piece, s in zip(pieces, record.layout or ()):
        if s.length:
            full.narrow(s.dim, s.start, s.length).copy_(piece.narrow(s.dim, 0, s.length))
    return full


def set_partial_grad(param: torch.Tensor, group: RankGroup) -> None:
    existing = param_info(param).partial_grad_group
    if existing is not None and existing != group:
        raise ValueError("a parameter's gradient can be completed over one group only")
    update_info(param, partial_grad_group=group)


def partial_grad_groups(params: Sequence[torch.Tensor]) -> list[tuple[RankGroup, list[torch.Tensor]]]:
    """The parameters whose gradient is a partial sum, by group: (group, its parameters)."""
    groups: dict[RankGroup, tuple[RankGroup, list[torch.Tensor]]] = {}
    for p in params:
        group = param_info(p).partial_grad_group
        if group is not None:
            groups.setdefault(group, (group, []))[1].append(p)
    return list(groups.values())


def grad_norm_weight(param: torch.Tensor, tp_size: int) -> float:
    """Weight of this parameter's squared gradient norm in a sum over the model-parallel ranks
    (tensor x pipeline), so that a tensor held by several ranks counts once: replicas over the
    tensor-parallel group share the weight, and the last pipeline stage's copy of a tied
    embedding counts zero."""
    record = param_info(param)
    if record.pipeline_duplicate:
        return 0.0
    return 1.0 / (record.shard.duplicates if record.shard is not None else tp_size)
