"""Data parallelism: every rank of a data-parallel group holds the same model part, and
gradients are averaged over the group.

`DataParallel` wraps this rank's model part. Its gradients live in buckets
(`buckets.GradientReducer`) reduced as backward fills them; with the distributed optimizer
(ZeRO stages 1 and 2) the parameters also live in one flat buffer laid out like the
gradients, so that after each rank has stepped its shard a bucket's parameters are gathered
by one all-gather, which can run behind the next forward (`overlap_param_gather`). Stage 3
shards the parameters themselves with PyTorch FSDP2 (`fully_sharded.py`).

Gradients are fp32 whatever the parameters' type (`param.main_grad`; also `param.grad` when
the parameters are fp32). They are synchronised on the last micro-batch of a step only (unless
`sync_every_micro_batch`, or at stage 2, which keeps no full gradient between micro-batches).
Zero them with `zero_grad_buffer` (or `model.zero_grad()`), never with
`optimizer.zero_grad()`, which would detach them from the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from paratron.distributed import comm
from paratron.model.loss import language_model_loss
from paratron.parallel.data.buckets import GradientReducer
from paratron.parallel.sharding import grad_norm_weight, partial_grad_groups

REDUCTION_MODES = {0: "all-reduce", 1: "reduce-scatter", 2: "reduce-scatter-shard"}


@dataclass(frozen=True)
class DataParallelSettings:
    """How gradients and parameters are shared over the data-parallel group (see config `ParallelConfig`)."""

    bucket_size: int = 40_000_000
    overlap_grad_reduce: bool = False
    sync_every_micro_batch: bool = False
    zero_stage: int = 0
    overlap_param_gather: bool = False


class DataParallel(nn.Module):
    """Wraps this rank's model part; `finish_grad_sync()` completes and averages its gradients.

    It also carries what the training step needs to know about the layout: the loss
    function (vocabulary-parallel under tensor parallelism), the model-parallel group (tensor x
    pipeline) over which gradient norms and overflow checks are summed, the random streams of
    tensor-parallel regions, and the pipeline runtime when the model is cut into stages."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, size: int,
                 loss_function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = language_model_loss,
                 tp_group: Any = None, tp_size: int = 1, rng_states: Any = None, model_group: Any = None,
                 pipeline: Any = None, settings: DataParallelSettings = DataParallelSettings(),
                 sharded_units: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.module = module
        self.group, self.size = group, size
        self.loss_function = loss_function
        self.tp_group, self.tp_size = tp_group, tp_size
        self.model_group = model_group
        self.rng_states = rng_states  # named generators of tensor-parallel regions (checkpointed)
        self.pipeline = pipeline  # parallel/pipeline/runtime.PipelineRuntime, or None
        self.settings = settings
        params = [p for p in module.parameters() if p.requires_grad]
        self._params = params  # a plain list: not registered twice
        self.sharded_units = sharded_units or []  # FSDP2 units (ZeRO stage 3)
        sharded = settings.zero_stage > 0 and size > 1
        # Gradients that are disjoint pieces over data-parallel ranks are summed over all ranks.
        self.norm_group = dist.group.WORLD if sharded and dist.get_world_size() > 1 else model_group
        # Each gradient's weight in a norm summed over ranks (see optim.build.clip_grad_norm).
        self.grad_norm_weights = None
        if comm.group_size(self.norm_group) > 1:
            self.grad_norm_weights = torch.tensor([grad_norm_weight(p, tp_size) for p in params],
                                                  device=_device_of(params[0]))
        self.reducer: GradientReducer | None = None
        self.param_buffer: torch.Tensor | None = None
        self._gathers: dict[int, Any] = {}
        if settings.zero_stage == 3:
            self._partial = partial_grad_groups(params)
            return
        # (on one rank, stage 2's per-micro-batch reduction would only add a copy: keep stage 1's buffer)
        mode = REDUCTION_MODES[1 if settings.zero_stage == 2 and size == 1 else settings.zero_stage]
        self.reducer = GradientReducer(params, group, settings.bucket_size, mode, settings.overlap_grad_reduce,
                                       late=_late_parameters(module, params),
                                       every_micro_batch=settings.sync_every_micro_batch)
        if settings.zero_stage > 0:
            self._flatten_parameters()

    def _flatten_parameters(self) -> None:
        """Move the parameters into one buffer laid out like the gradients."""
        reducer = self.reducer
        assert reducer is not None
        self.param_buffer = torch.zeros(reducer.total, dtype=self._params[0].dtype, device=reducer.device)
        for p in self._params:
            view = reducer.view(self.param_buffer, p)
            view.copy_(p.data)
            p.data = view
        if self.settings.overlap_param_gather:
            owners: dict[int, nn.Module] = {}
            for module in self.module.modules():
                mine = [p for p in module.parameters(recurse=False) if id(p) in reducer.bucket_of]
                if mine:
                    buckets = sorted({reducer.bucket_of[id(p)].index for p in mine})
                    module.register_forward_pre_hook(_waiter(self, buckets))
                    owners[id(module)] = module

    @property
    def trained_parameters(self) -> list[nn.Parameter]:
        """The parameters with gradients, in the order of `grad_norm_weights`."""
        return self._params

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # ---------------------------------------------------------------- gradients

    def require_grad_sync(self, enabled: bool) -> None:
        """Whether the coming backward passes finish the step's gradients (the last micro-batch)."""
        enabled = enabled or self.settings.sync_every_micro_batch
        if self.reducer is not None and self.settings.sync_every_micro_batch and self.reducer.grad_buffer is not None:
            self.reducer.wait_in_flight()  # the last micro-batch's reductions read the buffer we add to
        if self.reducer is not None:
            self.reducer.sync_enabled = enabled or self.settings.zero_stage == 2
        for unit in self.sharded_units:
            unit.set_requires_gradient_sync(enabled, recurse=False)

    def zero_grad_buffer(self) -> None:
        if self.reducer is not None:
            self.reducer.reset()
        else:
            for p in self._params:
                p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the buffer; gradients stay views into it whatever `set_to_none` says."""
        self.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        """Sum partial gradients over their groups, then average over the data-parallel group."""
        if self.reducer is None:
            self._finish_sharded()
            return
        if self.reducer.grad_buffer is not None and not self.reducer.separate:
            first = self._params[0]
            if first.grad is None or first.grad.data_ptr() != self.reducer.view(self.reducer.grad_buffer,
                                                                                first).data_ptr():
                raise RuntimeError("gradients were detached from the gradient buffer (optimizer.zero_grad()?); "
                                   "zero them with model.zero_grad_buffer()")
        self.reducer.finish()

    def _finish_sharded(self) -> None:
        """Stage 3: FSDP2 has reduce-scattered the gradients; sum partial ones (local shards line up
        over the partial group, whose members shard tensors of the same shape alike)."""
        for group, params in self._partial:
            comm.all_reduce_coalesced([_local(p.grad) for p in params if p.grad is not None], group)

    def gradients_for_norm(self) -> tuple[list[torch.Tensor], torch.Tensor | None, Any]:
        """(gradients, their norm weights, the group to sum squared norms over) for clipping, when the
        gradients are whole on this rank (plain data parallelism) or FSDP shards (stage 3)."""
        if self.reducer is not None and self.reducer.grad_buffer is not None:
            return [p.main_grad for p in self._params], self.grad_norm_weights, self.norm_group
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in self._params]
        return grads, self.grad_norm_weights, self.norm_group

    # ---------------------------------------------------------------- parameters (ZeRO stages 1, 2)

    def start_param_gather(self) -> None:
        """Each rank has updated its shards of `param_buffer`; gather every bucket's parameters, in
        the order forward needs them, and wait at once unless `overlap_param_gather`."""
        reducer = self.reducer
        if self.param_buffer is None or reducer is None or reducer.size == 1:
            return
        for bucket in reversed(reducer.buckets):
            lo, hi = bucket.shard(reducer.rank, reducer.size)
            comm.COUNTS["all_gather"] += 1
            self._gathers[bucket.index] = dist.all_gather_single(
                self.param_buffer[bucket.start:bucket.end], self.param_buffer[lo:hi], group=self.group, async_op=True)
        if not self.settings.overlap_param_gather:
            self.wait_param_gather()

    def wait_param_gather(self, buckets: list[int] | None = None) -> None:
        """Wait for the gathers of `buckets` (default: all) still in flight."""
        for index in list(self._gathers) if buckets is None else buckets:
            work = self._gathers.pop(index, None)
            if work is not None:
                work.wait()


def _waiter(model: DataParallel, buckets: list[int]):
    def hook(module: nn.Module, args: Any) -> None:
        if model._gathers:
            model.wait_param_gather(buckets)
    return hook


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (FSDP2's sharded tensors), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _device_of(param: torch.Tensor) -> torch.device:
    return _local(param).device


def _late_parameters(module: nn.Module, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Parameters whose gradient is complete only when backward is over: those summed over
    another group first, and those used in two places (a tied embedding, which under a V-shaped
    pipeline schedule gets its two gradients in separate backward passes)."""
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [p for p in params if getattr(p, "partial_grad_group", None) is not None or uses[id(p)] > 1]


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any parallel wrappers."""
    while isinstance(model, DataParallel):
        model = model.module
    return model
