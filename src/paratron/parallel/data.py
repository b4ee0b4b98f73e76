"""Data parallelism: every rank holds the whole model; gradients are averaged over the DP group.

Gradients live in one contiguous buffer (`param.grad` are views into it), so
accumulation over micro-batches adds in place and the reduction is a single
collective on the last micro-batch. Zero the buffer with `zero_grad_buffer`, never with
`optimizer.zero_grad()` (which would detach the views).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class DataParallel(nn.Module):
    """Wraps a model; `finish_grad_sync()` averages gradients over `group` after backward."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, size: int) -> None:
        super().__init__()
        self.module = module
        self.group, self.size = group, size
        params = [p for p in module.parameters() if p.requires_grad]
        self._params = params  # a plain list: not registered twice
        total = sum(p.numel() for p in params)
        self.grad_buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.grad_buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the buffer; gradients stay views into it whatever `set_to_none` says."""
        self.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        """Average gradients over the data-parallel group (a no-op on one rank)."""
        first = self._params[0].grad
        if first is None or first.data_ptr() != self.grad_buffer.data_ptr():
            raise RuntimeError("gradients were detached from the gradient buffer (optimizer.zero_grad()?); "
                               "zero them with model.zero_grad_buffer()")
        if self.size > 1:
            dist.all_reduce(self.grad_buffer, group=self.group)
            self.grad_buffer.mul_(1.0 / self.size)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any parallel wrappers."""
    while isinstance(model, DataParallel):
        model = model.module
    return model
