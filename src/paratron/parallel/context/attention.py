"""Attention over a row split across context-parallel ranks.

Each rank holds the queries, keys and values of its two chunks (`split.py`); the pattern's mask
is read from the true places of the tokens, so causal, sliding-window, document and block-sparse
attention all work unchanged. Both ways of reaching the other ranks' keys run the same plan
(`pairs.ring_plan`): at step s, this rank's query chunks against the key/value block of rank
i - s, the partial results merged by their log-sum-exp, chunk pairs the pattern never connects
skipped (where the causal load balance pays off).

- `p2p`: a ring (Liu et al.'s ring attention): the block of step s travels on to rank i + 1 while
  it is attended to. Backward passes the blocks round again, each with the gradient accumulated
  for it so far, which arrives home after the last step.
- `all_gather`: every key and value gathered first (backward: their gradients reduce-scattered),
  then the steps run on slices of the gathered row. Simpler; each rank holds the row's keys and
  values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.model.attention import AttentionPattern, TokenPlaces
from paratron.parallel.context.comm import Ring
from paratron.parallel.context.kernels import NEG_INF, merge
from paratron.parallel.context.pairs import BlockPair, pair_backward, pair_forward, ring_plan


def _forward_step(q: torch.Tensor, block: torch.Tensor, pairs: list[BlockPair], out: torch.Tensor, lse: torch.Tensor):
    """Merge the attention of `pairs` over `block` (keys and values stacked) into `out` and `lse`."""
    for pair in pairs:
        qs = pair.queries
        part, part_lse = pair_forward(q, block[0], block[1], pair)
        out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], part, part_lse)


def _backward_step(grad_out, q, block, out, lse, pairs: list[BlockPair], dq: torch.Tensor) -> torch.Tensor:
    """Add the queries' gradients of `pairs` to `dq`; returns the gradient of `block` (fp32)."""
    grads = torch.zeros(block.shape, dtype=torch.float32, device=q.device)
    for pair in pairs:
        qs, ks = pair.queries, pair.keys
        a, b, c = pair_backward(grad_out, q, block[0], block[1], out, lse, pair)
        dq[:, :, qs] += a
        grads[0][:, :, ks] += b
        grads[1][:, :, ks] += c
    return grads


def _accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, plan: list[list[BlockPair]]):
        out, lse = _accumulators(q)
        block = torch.stack((k, v))
        for step, pairs in enumerate(plan):
            pending = ring.shift(block) if step + 1 < len(plan) else None
            _forward_step(q, block, pairs, out, lse)
            if pending is not None:
                block = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plan = ring, plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plan = ctx.ring, ctx.plan
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = torch.stack((k, v))
        pending_grad = None
        for step, pairs in enumerate(plan):
            pending = ring.shift(block) if step + 1 < len(plan) else None
            grads = _backward_step(grad_out, q, block, out, lse, pairs, dq)
            if pending_grad is not None:
                grads += pending_grad.wait()  # what the ranks before added to this block's gradient
            pending_grad = ring.shift(grads)  # on to the next holder (after the last step: home)
            if pending is not None:
                block = pending.wait()
        assert pending_grad is not None
        dk, dv = pending_grad.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class _GatheredAttention(torch.autograd.Function):
    """The ring's steps over a gathered row: `blocks` [2, B, G, CP x T', D] (keys and values of every
    rank, in rank order); step s reads rank (i - s)'s slice."""

    @staticmethod
    def forward(ctx, q, blocks, rank: int, plan: list[list[BlockPair]]):
        out, lse = _accumulators(q)
        owner = _owner_slices(blocks.size(3) // len(plan), rank, len(plan))
        for step, pairs in enumerate(plan):
            _forward_step(q, blocks[:, :, :, owner(step)], pairs, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, blocks, out, lse)
        ctx.rank, ctx.plan = rank, plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, blocks, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads = torch.zeros(blocks.shape, dtype=torch.float32, device=q.device)
        owner = _owner_slices(blocks.size(3) // len(ctx.plan), ctx.rank, len(ctx.plan))
        for step, pairs in enumerate(ctx.plan):
            grads[:, :, :, owner(step)] += _backward_step(
                grad_out, q, blocks[:, :, :, owner(step)], out, lse, pairs, dq
            )
        return dq.to(q.dtype), grads.to(blocks.dtype), None, None


def _owner_slices(length: int, rank: int, size: int) -> Callable[[int], slice]:
    """Step -> the slice of the gathered row that rank (rank - step)'s tokens fill."""

    def owner(step: int) -> slice:
        o = (rank - step) % size
        return slice(o * length, (o + 1) * length)

    return owner


def _plan_key(pattern: AttentionPattern) -> tuple:
    """The cache key of a pattern's plan: its kind and settings, not the object (each layer holds its own
    pattern; equal ones share a plan, and a compiled block's guard on the key holds for every layer)."""
    return ("ring", type(pattern).__qualname__, tuple(sorted(vars(pattern).items())))


class ContextParallelAttention(nn.Module):
    """The attention core of a block under context parallelism (swapped for `AttentionCore`):
    queries, keys and values hold this rank's two chunks of each row."""

    def __init__(self, pattern: AttentionPattern, group: RankGroup, comm_type: str) -> None:
        super().__init__()
        self.pattern, self.group, self.comm_type = pattern, group, comm_type
        self.ring = Ring(group) if comm_type == "p2p" else None

    def plan(self, places: TokenPlaces) -> list[list[BlockPair]]:
        """The ring's block pairs for these places, made once per forward pass (the layers of equal
        patterns share them). A compiled block has them made before its graph runs (`parallel/compile.py`):
        making them branches on tensors' values (which chunk pairs the pattern connects), which a graph
        cannot."""
        return places.cached(_plan_key(self.pattern), lambda: ring_plan(self.pattern, places, self.group))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, places: TokenPlaces) -> torch.Tensor:
        plan = self.plan(places)
        if self.ring is not None:
            return _RingAttention.apply(q, k, v, self.ring, plan)
        blocks = comm.gather_from_sequence(torch.stack((k, v)), self.group, dim=3)
        return _GatheredAttention.apply(q, blocks, self.group.rank, plan)
