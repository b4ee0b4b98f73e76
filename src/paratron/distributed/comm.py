"""Collectives over a `RankGroup`, and their autograd forms: the communication of tensor and
sequence parallelism.

Each function is the identity when its group has one rank. Forward and backward are duals:

    copy_to_region          forward: identity             backward: all-reduce
    reduce_from_region      forward: all-reduce           backward: identity
    scatter_to_sequence     forward: keep my chunk of dim  backward: all-gather dim
    gather_from_sequence    forward: all-gather dim       backward: reduce-scatter dim
    reduce_scatter_to_sequence  forward: reduce-scatter dim  backward: all-gather dim

They run on gloo and NCCL alike (all_gather_single and reduce_scatter_single work on both).
Inside `torch.compile` (a compiled block, see `parallel/compile.py`) every collective is issued
synchronously, which dynamo turns into its functional collectives and keeps in the block's one
graph (the compiler may then reorder them against the matmuls); in eager, `async_op` overlaps
them with the computation that follows, as asked.
`count_collectives()` counts the collectives a block of code issues, for benchmarks and tests;
nothing is counted on the training path otherwise.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from paratron.distributed.topology import RankGroup

_COLLECTIVE_OPS = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::broadcast_": "broadcast",
    "c10d::send": "send",
    "c10d::recv_": "recv",
}
"""torch.distributed's dispatcher operations, by the collective they are."""


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the collectives issued inside the block, by kind (all_reduce, all_gather,
    reduce_scatter, ...). Opt-in and off the training path: it runs the block under the PyTorch
    profiler, whose records of torch.distributed's operations it counts when the block ends."""
    counts: Counter = Counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        yield counts
    for event in profile.events():
        kind = _COLLECTIVE_OPS.get(event.name)
        if kind is not None:
            counts[kind] += 1


# ---------------------------------------------------------------- plain collectives


def _overlapped(async_op: bool) -> bool:
    """Whether to launch a collective asynchronously: as asked in eager, never while dynamo traces
    (its functional collectives have no work handle; a handle would break the graph)."""
    return async_op and not torch.compiler.is_compiling()


def all_reduce(x: torch.Tensor, group: RankGroup, async_op: bool = False, op: Any = dist.ReduceOp.SUM) -> Any:
    """In place; returns the work handle when async_op (None on a single rank, or already done)."""
    if group.size == 1:
        return None
    return dist.all_reduce(x, op=op, group=group.process_group, async_op=_overlapped(async_op))


def all_reduce_coalesced(tensors: list[torch.Tensor], group: RankGroup) -> None:
    """Sum each tensor over `group` in place, with one collective for all of them."""
    if group.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group)
    position = 0
    for t in tensors:
        t.copy_(flat[position : position + t.numel()].view_as(t))
        position += t.numel()


def all_gather(x: torch.Tensor, dim: int, group: RankGroup, async_op: bool = False) -> Any:
    """Concatenate every rank's `x` along `dim`; with async_op, (output, work or None when done)."""
    size = group.size
    if size == 1:
        return (x, None) if async_op else x
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.size(0), *moved.shape[1:]))
    work = dist.all_gather_single(out, moved, group=group.process_group, async_op=_overlapped(async_op))
    result = out.movedim(0, dim)
    return (result, work) if async_op else result


def reduce_scatter(x: torch.Tensor, dim: int, group: RankGroup, async_op: bool = False) -> Any:
    """Sum over ranks, then keep this rank's chunk of `dim`; with async_op, (output, work or None when done)."""
    size = group.size
    if size == 1:
        return (x, None) if async_op else x
    if x.size(dim) % size:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} does not split over {size} ranks")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.size(0) // size, *moved.shape[1:]))
    work = dist.reduce_scatter_single(out, moved, group=group.process_group, async_op=_overlapped(async_op))
    result = out.movedim(0, dim)
    return (result, work) if async_op else result


def split(x: torch.Tensor, dim: int, group: RankGroup) -> torch.Tensor:
    """This rank's chunk of `dim` (no communication)."""
    size = group.size
    if size == 1:
        return x
    if x.size(dim) % size:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} does not split over {size} ranks")
    return x.chunk(size, dim=dim)[group.rank].contiguous()


# ---------------------------------------------------------------- autograd functions


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _dual(forward_op: Callable, backward_op: Callable, name: str) -> type:
    """An autograd function applying `forward_op(x, dim, group)` forward and its dual backward."""

    class Dual(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return forward_op(x, dim, group)

        @staticmethod
        def backward(ctx, grad):
            return backward_op(grad, ctx.dim, ctx.group), None, None

    Dual.__name__ = Dual.__qualname__ = name
    return Dual


_ScatterToSequence = _dual(split, all_gather, "_ScatterToSequence")
_GatherFromSequence = _dual(all_gather, reduce_scatter, "_GatherFromSequence")
_ReduceScatterToSequence = _dual(reduce_scatter, all_gather, "_ReduceScatterToSequence")


def _single(group: RankGroup) -> bool:
    return group.size == 1


def copy_to_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    return x if _single(group) else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    return x if _single(group) else _ReduceFromRegion.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: RankGroup, dim: int = 1) -> torch.Tensor:
    return x if _single(group) else _ScatterToSequence.apply(x, dim, group)


def gather_from_sequence(x: torch.Tensor, group: RankGroup, dim: int = 1) -> torch.Tensor:
    return x if _single(group) else _GatherFromSequence.apply(x, dim, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: RankGroup, dim: int = 1) -> torch.Tensor:
    return x if _single(group) else _ReduceScatterToSequence.apply(x, dim, group)
