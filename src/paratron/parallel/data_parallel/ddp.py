"""Data parallelism: every rank of a data-parallel group holds the same model part, and
gradients are averaged over the group (under context parallelism: summed over the ranks that
split each sequence and averaged over the data-parallel ones, in one reduction over both).

A MoE layer's experts are held by the expert-data-parallel ranks (on the experts' own grid,
which may span tensor- and context-parallel ranks): their gradients live in buckets of their
own, summed over that group (`expert_reducer`), which together saw every token of the stage
once, and averaged over the data-parallel replicas as the dense gradients are.

`DataParallelGradients` owns the gradients of this rank's model part and their
synchronisation. At ZeRO stages 0-2 they live in buckets (`buckets.GradientReducer`) reduced
as backward fills them (all-reduced, or reduce-scattered to the distributed optimizer's
shards); at stage 3 PyTorch FSDP2 reduce-scatters them (`fully_sharded.py`) and only the
partial sums over other groups are completed here.

Gradients are fp32 whatever the parameters' type (`main_grad(param)`; also `param.grad` when
the parameters are fp32), or bf16 with bf16 parameters under --grad-reduce-in-bf16
(`DataParallelSettings.grad_dtype`: accumulated over micro-batches and reduced in bf16, as in
Megatron-LM; the optimizer takes fp32 copies). They are synchronised on the last micro-batch
of a step only (unless `sync_every_micro_batch`, or at stage 2, which keeps no full gradient
between micro-batches).
Zero them with `zero()`, which keeps `param.grad` a view of the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.parallel.data_parallel.buckets import GradientReducer
from paratron.parallel.data_parallel.fully_sharded import local_tensor
from paratron.parallel.sharding import is_expert, param_info, partial_grad_groups

REDUCTION_MODES = {0: "all-reduce", 1: "reduce-scatter", 2: "reduce-scatter-shard"}


@dataclass(frozen=True)
class DataParallelSettings:
    """How gradients and parameters are shared over the data-parallel group (see config `ParallelConfig`)."""

    bucket_size: int = 40_000_000
    overlap_grad_reduce: bool = False
    sync_every_micro_batch: bool = False
    zero_stage: int = 0
    overlap_param_gather: bool = False
    grad_dtype: torch.dtype = torch.float32
    """The type gradients are accumulated and reduced in (bf16 under --grad-reduce-in-bf16)."""


class DataParallelGradients:
    """The gradients of `module`'s trained parameters and their mean over `group`.

    Per step: `zero()`, then before each micro-batch's backward `require_sync(last)`, then
    `finish()` once backward is over; `grad_ready(param)` reports a gradient completed outside
    autograd (the W operation of zero-bubble pipelines)."""

    def __init__(
        self,
        module: nn.Module,
        group: RankGroup,
        settings: DataParallelSettings = DataParallelSettings(),
        sharded_units: list[nn.Module] | None = None,
        expert_group: RankGroup | None = None,
        context_size: int = 1,
    ) -> None:
        """`expert_group`: the expert-data-parallel group of a MoE model's experts (None without experts).
        `context_size`: under context parallelism `group` spans the data- and context-parallel
        ranks, and the context-parallel ranks' gradients are parts of one sequence's: summed, not
        averaged (the mean over `group` is scaled by this)."""
        self.group, self.settings = group, settings
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.sharded_units = sharded_units or []  # FSDP2 units (ZeRO stage 3)
        self.reducer: GradientReducer | None = None
        self.expert_reducer: GradientReducer | None = None
        self.reducers: list[GradientReducer] = []
        if settings.zero_stage == 3:
            self._partial = partial_grad_groups(self.params)
            return
        late = _late_parameters(module, self.params)
        experts = [p for p in self.params if expert_group is not None and is_expert(p)]
        dense = [p for p in self.params if expert_group is None or not is_expert(p)]
        self.reducer = self._reducer(dense, group, late, post_scale=float(context_size))
        if experts:
            assert expert_group is not None
            # (the mean over the expert-data-parallel ranks, as a sum over them averaged over data parallelism)
            scale = expert_group.size * context_size / group.size
            self.expert_reducer = self._reducer(experts, expert_group, late, post_scale=scale)
        self.reducers = [r for r in (self.reducer, self.expert_reducer) if r is not None]
        self._owner = {id(p): r for r in self.reducers for p in r.params}

    def _reducer(
        self, params: list[nn.Parameter], group: RankGroup, late: list[nn.Parameter], post_scale: float = 1.0
    ) -> GradientReducer:
        settings = self.settings
        # (on one rank, stage 2's per-micro-batch reduction would only add a copy: keep stage 1's buffer)
        mode = REDUCTION_MODES[1 if settings.zero_stage == 2 and group.size == 1 else settings.zero_stage]
        return GradientReducer(
            params,
            group,
            settings.bucket_size,
            mode,
            settings.overlap_grad_reduce,
            late=late,  # (those of other reducers are ignored)
            every_micro_batch=settings.sync_every_micro_batch,
            post_scale=post_scale,
            grad_dtype=settings.grad_dtype,
        )

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s gradient in its reducer's buffer (ZeRO stages 0 and 1), of `settings.grad_dtype`."""
        return self._owner[id(param)].main_grad(param)

    def require_sync(self, enabled: bool) -> None:
        """Whether the coming backward passes finish the step's gradients (the last micro-batch)."""
        enabled = enabled or self.settings.sync_every_micro_batch
        for reducer in self.reducers:
            if self.settings.sync_every_micro_batch and reducer.grad_buffer is not None:
                reducer.wait_in_flight()  # the last micro-batch's reductions read the buffer we add to
            reducer.sync_enabled = enabled or self.settings.zero_stage == 2
        for unit in self.sharded_units:
            unit.set_requires_gradient_sync(enabled, recurse=False)

    def grad_ready(self, param: nn.Parameter) -> None:
        if self.reducer is not None:
            self._owner[id(param)].grad_ready(param)

    def zero(self) -> None:
        """Zero the gradients; they stay views of the buffer."""
        if self.reducer is not None:
            for reducer in self.reducers:
                reducer.reset()
        else:
            for p in self.params:
                p.grad = None

    def finish(self) -> None:
        """Sum partial gradients over their groups, then average over the data-parallel group."""
        if self.reducer is None:
            self._finish_sharded()
            return
        for reducer in self.reducers:
            if reducer.grad_buffer is not None and not reducer.separate:
                first = reducer.params[0]
                if first.grad is None or first.grad.data_ptr() != reducer.main_grad(first).data_ptr():
                    raise RuntimeError(
                        "gradients were detached from the gradient buffer (optimizer.zero_grad()?); "
                        "zero them with model.zero_grad()"
                    )
        for reducer in self.reducers:
            reducer.finish()

    def _finish_sharded(self) -> None:
        """Stage 3: FSDP2 has reduce-scattered the gradients; sum partial ones (local shards line up
        over the partial group, whose members shard tensors of the same shape alike)."""
        for group, params in self._partial:
            comm.all_reduce_coalesced([local_tensor(p.grad) for p in params if p.grad is not None], group)


def _late_parameters(module: nn.Module, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Parameters whose gradient is complete only when backward is over: those summed over
    another group first, and those used in two places (a tied embedding, which under a V-shaped
    pipeline schedule gets its two gradients in separate backward passes)."""
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [p for p in params if param_info(p).partial_grad_group is not None or uses[id(p)] > 1]
