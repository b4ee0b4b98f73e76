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
    expert_shard       a MoE layer's experts (set at every layout): this rank holds experts
                       [start, start + length) of dimension 0, the other expert-parallel ranks
                       the others. An expert's `shard` and `layout` (its split over another
                       dimension) are over the expert-tensor-parallel ranks, not the tensor-
                       parallel ones, and its gradient is reduced over the expert-data-parallel
                       group, not the data-parallel one (the experts' own grid: see
                       `distributed.topology`)

A rank's part of a single-device tensor is thus a box: a range of dimension 0 (experts) and a
range of one other dimension (tensor parallelism, possibly in `blocks` equal blocks, as the
gate and up rows of stacked SwiGLU experts), read and written through `place`.
"""

from __future__ import annotations

import dataclasses
import math
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
    blocks: int = 1
    """The dimension is `blocks` equal blocks (gate rows, then up rows) sharded alike: this rank holds
    [start, start + length) of each, one after the other."""


@dataclass(frozen=True)
class ParamInfo:
    """The parallel facts of one parameter (see the module docstring)."""

    shard: Shard | None = None
    layout: tuple[Shard, ...] | None = None
    partial_grad_group: RankGroup | None = None
    pipeline_duplicate: bool = False
    deferred_grad: bool = False
    expert_shard: Shard | None = None


def param_info(param: torch.Tensor) -> ParamInfo:
    """The parameter's record (the default one, a whole replicated tensor, when none was set)."""
    return getattr(param, _ATTRIBUTE, ParamInfo())


def update_info(param: torch.Tensor, **changes: object) -> None:
    setattr(param, _ATTRIBUTE, dataclasses.replace(param_info(param), **changes))


def set_info(param: torch.Tensor, record: ParamInfo) -> None:
    setattr(param, _ATTRIBUTE, record)


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
    record = param_info(param)
    shape = list(param.shape)
    for shard in (record.shard, record.expert_shard):
        if shard is not None:
            shape[shard.dim] = shard.full_size
    return tuple(shape)


Index = tuple[slice, ...]


def _ranges(shard: Shard | None, local_size: int) -> list[tuple[slice, slice]]:
    """(single-device range, local range) pairs of one dimension."""
    if shard is None:
        return [(slice(None), slice(None))]
    if not shard.length:
        return []
    full_block, local_block = shard.full_size // shard.blocks, local_size // shard.blocks
    return [
        (
            slice(b * full_block + shard.start, b * full_block + shard.start + shard.length),
            slice(b * local_block, b * local_block + shard.length),
        )
        for b in range(shard.blocks)
    ]


def boxes(shape: Sequence[int], shard: Shard | None, expert_shard: Shard | None = None) -> list[tuple[Index, Index]]:
    """(index into the single-device tensor, index into the local tensor of `shape`) of every box a
    rank with these shards holds; padding is in no box."""
    pairs: list[tuple[Index, Index]] = [((), ())]
    for dim in range(len(shape)):
        shard_here = shard if shard is not None and shard.dim == dim else None
        if expert_shard is not None and expert_shard.dim == dim:
            shard_here = expert_shard
        pairs = [(f + (a,), lo + (b,)) for f, lo in pairs for a, b in _ranges(shard_here, shape[dim])]
    return pairs


def place(param: torch.Tensor) -> list[tuple[Index, Index]]:
    """Where this rank's part of `param` lies: (single-device index, local index) pairs."""
    record = param_info(param)
    return boxes(param.shape, record.shard, record.expert_shard)


def bounded(index: Index, shape: Sequence[int]) -> Index:
    """`index` with explicit start and stop in every dimension of a tensor of `shape`."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def whole_box(shape: Sequence[int]) -> Index:
    """The box of a whole tensor of `shape`."""
    return tuple(slice(0, n) for n in shape)


def box_shape(box: Index) -> tuple[int, ...]:
    """The shape of a box with explicit bounds."""
    return tuple(s.stop - s.start for s in box)


def box_size(box: Index) -> int:
    """How many elements a box with explicit bounds holds."""
    return math.prod(box_shape(box))


def take_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor (padding zeroed) from the single-device tensor."""
    record = param_info(param)
    if record.shard is None and record.expert_shard is None:
        return full
    local = full.new_zeros(param.shape)  # (a plain tensor also for an FSDP2-sharded parameter)
    for whole, mine in place(param):
        local[mine] = full[whole]
    return local


def gather_full(
    param: torch.Tensor,
    group: RankGroup,
    tensor: torch.Tensor | None = None,
    expert_group: RankGroup | None = None,
    expert_tp_group: RankGroup | None = None,
) -> torch.Tensor:
    """The single-device tensor, assembled from every tensor-parallel rank's slice (for an
    expert's weights: every expert-tensor-parallel rank's slice over `expert_tp_group`, then every
    expert-parallel rank's experts over `expert_group`); collective. `tensor` (default: the
    parameter itself) may be anything laid out like it, e.g. its gradient."""
    tensor = (param if tensor is None else tensor).detach()
    record = param_info(param)
    if record.expert_shard is not None and record.shard is not None:
        if expert_tp_group is None:
            raise ValueError("an expert's slices are gathered over the expert-TP group: pass expert_tp_group")
        group = expert_tp_group
    if record.shard is not None and group.size > 1:
        pieces = [torch.empty_like(tensor) for _ in range(group.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=group.process_group)
        shape = list(tensor.shape)
        shape[record.shard.dim] = record.shard.full_size
        full = tensor.new_empty(shape)
        for piece, s in zip(pieces, record.layout or ()):
            for whole, mine in boxes(piece.shape, s):
                full[whole] = piece[mine]
        tensor = full
    elif record.shard is not None and tensor.size(record.shard.dim) > record.shard.full_size:
        tensor = tensor.narrow(record.shard.dim, 0, record.shard.full_size)  # (one rank, padded: the real rows)
    if record.expert_shard is not None:
        if expert_group is None:
            raise ValueError("an expert's weights are gathered over the expert-parallel group: pass expert_group")
        if expert_group.size > 1:
            pieces = [torch.empty_like(tensor) for _ in range(expert_group.size)]
            dist.all_gather(pieces, tensor.contiguous(), group=expert_group.process_group)
            tensor = torch.cat(pieces, dim=record.expert_shard.dim)
    return tensor


def is_expert(param: torch.Tensor) -> bool:
    """Whether `param` is a MoE layer's experts (on the experts' grid, reduced over expert-data-parallel ranks)."""
    return param_info(param).expert_shard is not None


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


def grad_norm_weight(param: torch.Tensor, tp_size: int, replicas: tuple[int, int] = (1, 1)) -> float:
    """Weight of this parameter's squared gradient norm in a sum over the ranks that hold the
    model's gradient (see `ParallelModel.norm_group`), so that a tensor held by several ranks
    counts once: replicas over the tensor-parallel group share the weight, and the last pipeline
    stage's copy of a tied embedding counts zero. `replicas` = (dense, expert): how many ranks of
    the norm's group hold each dense and each expert gradient whole (data-parallel replicas,
    when the norm is summed over them; an expert's replicas are its expert-data-parallel ranks,
    which include any tensor-parallel ranks that hold it whole)."""
    record = param_info(param)
    if record.pipeline_duplicate:
        return 0.0
    if record.expert_shard is not None:
        return 1.0 / ((record.shard.duplicates if record.shard is not None else 1) * replicas[1])
    return 1.0 / ((record.shard.duplicates if record.shard is not None else tp_size) * replicas[0])
