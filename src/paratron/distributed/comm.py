"""Collectives as autograd functions: the communication of tensor and sequence parallelism.

Each function is the identity when its group has one rank. Forward and backward are duals:

    copy_to_region          forward: identity             backward: all-reduce
    reduce_from_region      forward: all-reduce           backward: identity
    scatter_to_region       forward: keep my last-dim chunk  backward: all-gather last dim
    gather_from_region      forward: all-gather last dim  backward: keep my chunk
    scatter_to_sequence     forward: keep my chunk of dim  backward: all-gather dim
    gather_from_sequence    forward: all-gather dim       backward: reduce-scatter dim
    reduce_scatter_to_sequence  forward: reduce-scatter dim  backward: all-gather dim

They run on gloo and NCCL alike (all_gather_single and reduce_scatter_single work on both).
`COUNTS` tallies the collectives issued, by kind, for the benchmarks.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

COUNTS: Counter = Counter()


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def group_rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


# ---------------------------------------------------------------- plain collectives


def all_reduce(x: torch.Tensor, group: Any, async_op: bool = False, op: Any = dist.ReduceOp.SUM) -> Any:
    """In place; returns the work handle when async_op (None on a single rank)."""
    if group_size(group) == 1:
        return None
    COUNTS["all_reduce"] += 1
    return dist.all_reduce(x, op=op, group=group, async_op=async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum each tensor over `group` in place, with one collective for all of them."""
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group)
    position = 0
    for t in tensors:
        t.copy_(flat[position:position + t.numel()].view_as(t))
        position += t.numel()


def all_gather(x: torch.Tensor, dim: int, group: Any, async_op: bool = False) -> Any:
    """Concatenate every rank's `x` along `dim`; with async_op, (output, work)."""
    size = group_size(group)
    if size == 1:
        return (x, None) if async_op else x
    COUNTS["all_gather"] += 1
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.size(0), *moved.shape[1:]))
    work = dist.all_gather_single(out, moved, group=group, async_op=async_op)
    result = out.movedim(0, dim)
    return (result, work) if async_op else result


def reduce_scatter(x: torch.Tensor, dim: int, group: Any, async_op: bool = False) -> Any:
    """Sum over ranks, then keep this rank's chunk of `dim`; with async_op, (output, work)."""
    size = group_size(group)
    if size == 1:
        return (x, None) if async_op else x
    if x.size(dim) % size:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} does not split over {size} ranks")
    COUNTS["reduce_scatter"] += 1
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.size(0) // size, *moved.shape[1:]))
    work = dist.reduce_scatter_single(out, moved, group=group, async_op=async_op)
    result = out.movedim(0, dim)
    return (result, work) if async_op else result


def split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's chunk of `dim` (no communication)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.size(dim) % size:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} does not split over {size} ranks")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


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


_ScatterToRegion = _dual(split, all_gather, "_ScatterToRegion")
_GatherFromRegion = _dual(all_gather, split, "_GatherFromRegion")
_GatherFromSequence = _dual(all_gather, reduce_scatter, "_GatherFromSequence")
_ReduceScatterToSequence = _dual(reduce_scatter, all_gather, "_ReduceScatterToSequence")


def _single(group: Any) -> bool:
    return group_size(group) == 1


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if _single(group) else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if _single(group) else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if _single(group) else _ScatterToRegion.apply(x, -1, group)


def gather_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if _single(group) else _GatherFromRegion.apply(x, -1, group)


def scatter_to_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    return x if _single(group) else _ScatterToRegion.apply(x, dim, group)


def gather_from_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    return x if _single(group) else _GatherFromSequence.apply(x, dim, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    return x if _single(group) else _ReduceScatterToSequence.apply(x, dim, group)
