"""Attention over a row split across context-parallel ranks.

Each rank holds the queries, keys and values of its two chunks (`split.py`); the pattern's mask
is read from the true places of the tokens, so causal, sliding-window, document and block-sparse
attention all work unchanged. Two ways to reach the other ranks' keys:

- `all_gather`: gather every key and value (backward: reduce-scatter their gradients), then one
  masked SDPA of the local queries over the whole row;
- `p2p`: a ring (Liu et al.'s ring attention): at step s this rank attends to the key/value block
  of rank i - s while that block travels on to rank i + 1, merging the partial results by their
  log-sum-exp. Backward passes the blocks round again, each with the gradient accumulated for it
  so far, which arrives home after the last step. Pairs of chunks the pattern never connects are
  skipped, which is where the causal load balance pays off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.model.attention import AttentionPattern, TokenPlaces
from paratron.parallel.context.comm import Ring
from paratron.parallel.context.kernels import NEG_INF, merge
from paratron.parallel.context.pairs import BlockPair, pair_backward, pair_forward, ring_plan
from paratron.parallel.context.split import token_index


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, plan: list[list[BlockPair]]):
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)
        block = torch.stack((k, v))
        for step, pairs in enumerate(plan):
            pending = ring.shift(block) if step + 1 < len(plan) else None
            for pair in pairs:
                qs = pair.queries
                part, part_lse = pair_forward(q, block[0], block[1], pair)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], part, part_lse)
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
            grads = torch.zeros(block.shape, dtype=torch.float32, device=q.device)
            for pair in pairs:
                qs, ks = pair.queries, pair.keys
                a, b, c = pair_backward(grad_out, q, block[0], block[1], out, lse, pair)
                dq[:, :, qs] += a
                grads[0][:, :, ks] += b
                grads[1][:, :, ks] += c
            if pending_grad is not None:
                grads += pending_grad.wait()  # what the ranks before added to this block's gradient
            pending_grad = ring.shift(grads)  # on to the next holder (after the last step: home)
            if pending is not None:
                block = pending.wait()
        assert pending_grad is not None
        dk, dv = pending_grad.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class ContextParallelAttention(nn.Module):
    """The attention core of a block under context parallelism (swapped for `AttentionCore`):
    queries, keys and values hold this rank's two chunks of each row."""

    def __init__(self, pattern: AttentionPattern, group: RankGroup, comm_type: str) -> None:
        super().__init__()
        self.pattern, self.group, self.comm_type = pattern, group, comm_type
        self.ring = Ring(group) if comm_type == "p2p" else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, places: TokenPlaces) -> torch.Tensor:
        if self.ring is not None:
            plan = places.cached(("ring", self.pattern), lambda: ring_plan(self.pattern, places, self.group))
            return _RingAttention.apply(q, k, v, self.ring, plan)
        keys = comm.gather_from_sequence(k, self.group, dim=2)
        values = comm.gather_from_sequence(v, self.group, dim=2)
        key_index = places.cached(("gathered", self.group.size), lambda: self._gathered_index(places))
        mask = places.mask(self.pattern, key_index)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=k.size(1) != q.size(1))

    def _gathered_index(self, places: TokenPlaces) -> torch.Tensor:
        """Places of the gathered keys: every rank's tokens, in rank order."""
        length = places.index.numel() * self.group.size
        device = places.index.device
        return torch.cat([token_index(length, self.group.size, r, device) for r in range(self.group.size)])
