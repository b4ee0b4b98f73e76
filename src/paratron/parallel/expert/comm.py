"""The communication of expert parallelism: all-to-all with uneven splits, in autograd form.

    all_to_all(x, output_splits, input_splits)   forward: rows [input_splits[r] ...] go to rank r
                                                 backward: the same exchange reversed

All-gather and reduce-scatter along the tokens come from `distributed.comm` (their autograd
forms `gather_from_sequence` / `reduce_scatter_to_sequence` along dimension 0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratron.distributed.topology import RankGroup


def exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: RankGroup) -> torch.Tensor:
    """Send rows of `x` to every rank of `group` (`input_splits[r]` rows to rank r, in order) and
    receive `output_splits[r]` rows from each rank r, concatenated in rank order."""
    if group.size == 1:
        return x
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group.process_group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: RankGroup):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: RankGroup) -> torch.Tensor:
    """`exchange`, differentiable: the gradient travels back the way the rows came."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)
