"""Gradient buckets: where each gradient lives, and its reduction over the data-parallel group.

Layout (`plan_buckets`): parameters are laid out in one flat space in reverse order of
registration, roughly the order in which backward produces their gradients, and cut into
buckets of at least `bucket_size` elements. Each bucket is padded to a multiple of the
data-parallel size, so it splits into equal shards; rank r owns shard r of every bucket (the
distributed optimizer's partition). Parameters whose gradient is complete only at the end of
backward (summed over another group first, or used by two pipeline chunks of this rank) sit
in trailing buckets of their own, so they never hold up the others.

Reduction (`GradientReducer`): a post-accumulate-grad hook marks a parameter ready; when the
last parameter of a bucket is ready and synchronisation is on, the bucket's reduction starts
asynchronously (`overlap`) while backward goes on. The bucket is scaled by 1/size first and
summed, so the result is the data-parallel mean; `post_scale` multiplies the step's result once
more (expert gradients: their mean over the expert-data-parallel ranks is scaled to the mean
over all data-parallel ranks, whose tokens they saw). Three ways to keep gradients:

- `all-reduce`: a persistent full buffer (`main_grad(param)` are views into it); plain DDP.
- `reduce-scatter`: the same buffer, but only this rank's shard is reduced (ZeRO-1).
- `reduce-scatter-shard`: no persistent full buffer: a bucket's buffer exists from its first
  gradient to the end of its reduction, which adds into a persistent shard (ZeRO-2); gradients
  are reduced after every micro-batch.

Gradients are kept in `grad_dtype` (fp32 by default), whatever the parameters' type. When the
two agree, `param.grad` is the parameter's view of the buffer and autograd accumulates into it
directly; when the parameters are 16-bit, autograd leaves a 16-bit `param.grad` that the hook
adds into the fp32 buffer and drops (Megatron-LM's "main gradients"). A bf16 `grad_dtype` with
bf16 parameters (--grad-reduce-in-bf16) is the first case: accumulation and reduction in bf16.

On gloo the two reduce-scatter modes all-reduce the bucket and keep their shard of the
result, because gloo's reduce-scatter is slower than its all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.parallel.sharding import param_info, partial_grad_groups

MODES = ("all-reduce", "reduce-scatter", "reduce-scatter-shard")


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    start: int
    end: int
    """[start, end) in the flat space; end - start is a multiple of the data-parallel size."""
    late: bool = False
    """Reduced only when backward is over (see the module docstring)."""
    pending: set[int] = field(default_factory=set)
    buffer: torch.Tensor | None = None
    work: Any = None
    dirty: bool = False
    """Holds gradients not yet reduced."""
    shard_out: torch.Tensor | None = None

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """This rank's [start, end) of the bucket in the flat space."""
        length = (self.end - self.start) // size
        return self.start + rank * length, self.start + (rank + 1) * length


def plan_buckets(
    params: list[nn.Parameter], late: Iterable[nn.Parameter], bucket_size: int, size: int
) -> tuple[dict[int, int], list[Bucket], int]:
    """Offsets (by `id(param)`), buckets and total padded length for `params` (in registration order)."""
    late_ids = {id(p) for p in late}
    ordered = [p for p in reversed(params) if id(p) not in late_ids]
    trailing = [p for p in reversed(params) if id(p) in late_ids]
    offsets: dict[int, int] = {}
    buckets: list[Bucket] = []
    position = 0
    for group, is_late in ((ordered, False), (trailing, True)):
        members: list[nn.Parameter] = []
        start = position
        for i, p in enumerate(group):
            offsets[id(p)] = position
            position += p.numel()
            members.append(p)
            if position - start >= bucket_size or i == len(group) - 1:
                position = start + _round_up(position - start, size)
                buckets.append(Bucket(len(buckets), members, start, position, late=is_late))
                members, start = [], position
    return offsets, buckets, position


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class GradientReducer:
    """Owns the gradient storage of `params` and reduces it over `group` (see the module docstring)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: RankGroup,
        bucket_size: int,
        mode: str = "all-reduce",
        overlap: bool = False,
        late: Iterable[nn.Parameter] = (),
        scatter_by_all_reduce: bool | None = None,
        every_micro_batch: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        post_scale: float = 1.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.params, self.group, self.mode, self.overlap = params, group, mode, overlap
        self.post_scale = post_scale
        # Without overlap, buckets are reduced in backward only when every micro-batch needs it
        # (a reduction waited for in a hook stalls backward); otherwise all at once in finish().
        self.every_micro_batch = every_micro_batch or mode == "reduce-scatter-shard"
        self.size, self.rank = group.size, group.rank
        self.offsets, self.buckets, self.total = plan_buckets(params, late, bucket_size, self.size)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        first = params[0]
        self.dtype, self.device = grad_dtype, first.device
        # parameters of another type (16-bit ones, fp32 buffer): autograd's gradients are added in, then dropped
        self.separate = any(p.dtype != grad_dtype for p in params)
        self.sync_enabled = True
        # gloo's reduce-scatter takes 2-2.5x the time of its all-reduce of the same buffer (4M fp32
        # on 2 ranks: 30 vs 12 ms), where NCCL's moves half an all-reduce's bytes: on gloo a
        # bucket is all-reduced and this rank keeps its shard of the result
        if scatter_by_all_reduce is None:
            scatter_by_all_reduce = self.size > 1 and dist.get_backend(group.process_group) == "gloo"
        self.scatter_by_all_reduce = scatter_by_all_reduce and mode != "all-reduce"
        self.partial = partial_grad_groups(params)
        self._main_grads: dict[int, torch.Tensor] = {}
        if mode == "reduce-scatter-shard":
            self.grad_buffer = None
            self.grad_shard = torch.zeros(self.total // self.size, dtype=self.dtype, device=self.device)
        else:
            self.grad_buffer = torch.zeros(self.total, dtype=self.dtype, device=self.device)
            for b in self.buckets:
                b.buffer = self.grad_buffer[b.start : b.end]
            for p in params:
                self._main_grads[id(p)] = self.view(self.grad_buffer, p)
                p.grad = None if self.separate else self._main_grads[id(p)]
        # (a deferred weight gradient is reported by the pipeline's W operation instead, see
        # pipeline/zero_bubble.py; autograd's hook would fire in B, before it exists)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self.grad_ready) for p in params if not param_info(p).deferred_grad
        ]
        self.reset()

    # ---------------------------------------------------------------- layout helpers

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s gradient (of `grad_dtype`): its view of the persistent buffer (not at ZeRO stage 2)."""
        return self._main_grads[id(param)]

    def view(self, flat: torch.Tensor, param: nn.Parameter, base: int = 0) -> torch.Tensor:
        """`param`'s place in a tensor that covers the flat space from `base`."""
        offset = self.offsets[id(param)] - base
        return flat[offset : offset + param.numel()].view_as(param)

    def local_pieces(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """(param, first element, last element + 1 within the param, position in the flat space) of
        every piece of a parameter that lies in this rank's shards."""
        pieces = []
        for b in self.buckets:
            lo, hi = b.shard(self.rank, self.size)
            for p in b.params:
                start = self.offsets[id(p)]
                a, z = max(lo, start), min(hi, start + p.numel())
                if a < z:
                    pieces.append((p, a - start, z - start, a))
        return pieces

    def shard_position(self, flat_position: int) -> int:
        """Where a flat-space position of this rank's shards lies in the concatenated shards."""
        for i, b in enumerate(self.buckets):
            lo, hi = b.shard(self.rank, self.size)
            if lo <= flat_position < hi:
                return sum((bb.end - bb.start) // self.size for bb in self.buckets[:i]) + flat_position - lo
        raise ValueError(f"position {flat_position} is not in this rank's shards")

    # ---------------------------------------------------------------- reduction

    def reset(self) -> None:
        """Ready for a new step: zero the gradients (and the shard), nothing in flight."""
        for b in self.buckets:
            b.pending = {id(p) for p in b.params}
            b.work, b.shard_out, b.dirty = None, None, False
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        else:
            self.grad_shard.zero_()
            for b in self.buckets:
                b.buffer = None

    def grad_ready(self, param: nn.Parameter) -> None:
        """Called when `param`'s gradient of a backward pass has been accumulated."""
        bucket = self.bucket_of[id(param)]
        if self.mode == "reduce-scatter-shard":
            self._wait(bucket)  # its previous micro-batch's reduction frees the buffer
            if bucket.buffer is None:
                bucket.buffer = torch.zeros(bucket.end - bucket.start, dtype=self.dtype, device=self.device)
            self.view(bucket.buffer, param, bucket.start).add_(param.grad)
            param.grad = None
        elif self.separate and param.grad is not None:
            self._main_grads[id(param)].add_(param.grad)
            param.grad = None
        bucket.dirty = True
        if not self.sync_enabled or bucket.late or not (self.overlap or self.every_micro_batch):
            return
        bucket.pending.discard(id(param))
        if not bucket.pending:
            self._launch(bucket)
            if not self.overlap:
                self._wait(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.pending = {id(p) for p in bucket.params}
        bucket.dirty = False
        if self.size == 1:
            bucket.work = None
            self._finish_bucket(bucket)
            return
        bucket.buffer.mul_(1.0 / self.size)
        if self.mode == "all-reduce":
            bucket.work = comm.all_reduce(bucket.buffer, self.group, async_op=True)
        elif self.scatter_by_all_reduce:  # this rank's shard is then read from the whole result
            bucket.shard_out = None
            bucket.work = comm.all_reduce(bucket.buffer, self.group, async_op=True)
        else:
            lo, hi = bucket.shard(self.rank, self.size)
            if self.mode == "reduce-scatter":  # in place: the result lands in this rank's shard
                bucket.shard_out = bucket.buffer[lo - bucket.start : hi - bucket.start]
            else:
                bucket.shard_out = torch.empty(hi - lo, dtype=self.dtype, device=self.device)
            bucket.work = dist.reduce_scatter_single(
                bucket.shard_out, bucket.buffer, group=self.group.process_group, async_op=True
            )

    def _wait(self, bucket: Bucket) -> None:
        if bucket.work is None:
            return
        bucket.work.wait()
        bucket.work = None
        self._finish_bucket(bucket)

    def _finish_bucket(self, bucket: Bucket) -> None:
        if self.mode == "all-reduce" or bucket.buffer is None:
            return
        lo, hi = bucket.shard(self.rank, self.size)
        if self.mode == "reduce-scatter":
            # the other shards still hold this rank's own sums; clear them when a later
            # micro-batch's reduction of this step would add them again
            local = bucket.buffer[lo - bucket.start : hi - bucket.start]
            if self.size > 1 and self.every_micro_batch and not self.scatter_by_all_reduce:
                kept = local.clone()
                bucket.buffer.zero_()
                local.copy_(kept)
        else:
            out = (
                bucket.shard_out
                if bucket.shard_out is not None
                else bucket.buffer[lo - bucket.start : hi - bucket.start]
            )
            position = self.shard_position(lo)
            self.grad_shard[position : position + hi - lo].add_(out)
            bucket.buffer, bucket.shard_out = None, None

    def wait_in_flight(self) -> None:
        """Wait for every reduction started so far (before gradients accumulate into a persistent
        buffer again, which would race with a reduction still reading it)."""
        for b in self.buckets:
            self._wait(b)

    def finish(self) -> None:
        """End of a step's backward: complete partial gradients, reduce what is left, wait for all."""
        for group, params in self.partial:
            buckets = [self.bucket_of[id(p)] for p in params]
            comm.all_reduce_coalesced(
                [self.view(b.buffer, p, b.start) for p, b in zip(params, buckets) if b.buffer is not None], group
            )
        for b in self.buckets:
            if b.dirty and b.work is None:
                self._launch(b)
        for b in self.buckets:
            self._wait(b)
        if self.post_scale != 1.0:
            (self.grad_buffer if self.grad_buffer is not None else self.grad_shard).mul_(self.post_scale)
