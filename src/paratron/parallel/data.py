"""Data parallelism: every rank of a data-parallel group holds the same model part; gradients
are averaged over the group.

Gradients live in one contiguous buffer (`param.grad` are views into it), so accumulation
over micro-batches adds in place and the reduction is a single collective after the last
micro-batch. Before it, gradients that are partial sums over some other group (see
`parallel/sharding.py`) are completed there. Zero the buffer with `zero_grad_buffer` (or
`model.zero_grad()`), never with `optimizer.zero_grad()`, which would detach the views.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from paratron.distributed import comm
from paratron.model.loss import language_model_loss
from paratron.parallel.sharding import grad_norm_weight


class DataParallel(nn.Module):
    """Wraps this rank's model part; `finish_grad_sync()` completes and averages its gradients.

    It also carries what the training step needs to know about the layout: the loss
    function (vocabulary-parallel under tensor parallelism), the model-parallel group (tensor x
    pipeline) over which gradient norms and overflow checks are summed, the random streams of
    tensor-parallel regions, and the pipeline runtime when the model is cut into stages."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, size: int,
                 loss_function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = language_model_loss,
                 tp_group: Any = None, tp_size: int = 1, rng_states: Any = None, model_group: Any = None,
                 pipeline: Any = None) -> None:
        super().__init__()
        self.module = module
        self.group, self.size = group, size
        self.loss_function = loss_function
        self.tp_group, self.tp_size = tp_group, tp_size
        self.model_group = model_group
        self.rng_states = rng_states  # named generators of tensor-parallel regions (checkpointed)
        self.pipeline = pipeline  # parallel/pipeline/runtime.PipelineRuntime, or None
        params = [p for p in module.parameters() if p.requires_grad]
        self._params = params  # a plain list: not registered twice
        # Each gradient's weight in a norm summed over the model-parallel group (see clip_grad_norm).
        self.grad_norm_weights = None
        if comm.group_size(self.model_group) > 1:
            self.grad_norm_weights = torch.tensor([grad_norm_weight(p, tp_size) for p in params],
                                                  device=params[0].device)
        total = sum(p.numel() for p in params)
        self.grad_buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.grad_buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        partial: dict[int, tuple[Any, list[nn.Parameter]]] = {}
        for p in params:
            group_of_p = getattr(p, "partial_grad_group", None)
            if group_of_p is not None:
                partial.setdefault(id(group_of_p), (group_of_p, []))[1].append(p)
        self._partial = list(partial.values())

    @property
    def trained_parameters(self) -> list[nn.Parameter]:
        """The parameters with gradients, in buffer order (that of `grad_norm_weights`)."""
        return self._params

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the buffer; gradients stay views into it whatever `set_to_none` says."""
        self.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        """Sum partial gradients over their groups, then average over the data-parallel group."""
        first = self._params[0].grad
        if first is None or first.data_ptr() != self.grad_buffer.data_ptr():
            raise RuntimeError("gradients were detached from the gradient buffer (optimizer.zero_grad()?); "
                               "zero them with model.zero_grad_buffer()")
        for group, params in self._partial:
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            comm.all_reduce(flat, group)
            for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(summed)
        if self.size > 1:
            dist.all_reduce(self.grad_buffer, group=self.group)
            self.grad_buffer.mul_(1.0 / self.size)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any parallel wrappers."""
    while isinstance(model, DataParallel):
        model = model.module
    return model
