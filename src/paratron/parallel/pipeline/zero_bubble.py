"""Splitting a backward pass into input gradients (B) and weight gradients (W).

Zero-bubble schedules run B as soon as possible, because the previous stage waits for its
result, and W later, where the rank would otherwise idle. The linear layers of the
transformer blocks (nearly all of a block's weight-gradient work) are switched to a linear
whose backward returns only the input gradient while a `WeightGradStore` is capturing; it
stores the layer input and output gradient instead, and W computes grad_W = g^T x from them.
All other parameters (norms, embeddings, the output layer, tensor-parallel layers) get
their gradients in B, as usual.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from paratron.parallel.tensor.layers import _compute_dtype


class WeightGradStore:
    """Deferred weight-gradient work, per (micro-batch, chunk)."""

    def __init__(self) -> None:
        self._capturing: Any = None
        self.on_accumulated: Any = None  # called with each parameter whose gradient W completed
        self._pending: dict[Any, list[tuple[nn.Parameter, nn.Parameter | None, torch.Tensor, torch.Tensor]]] = {}

    @contextlib.contextmanager
    def capture(self, key: Any) -> Iterator[None]:
        """Within this context, deferring linears store their weight-gradient inputs under `key`."""
        self._capturing = key
        self._pending.setdefault(key, [])
        try:
            yield
        finally:
            self._capturing = None

    def defer(self, weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, grad: torch.Tensor) -> bool:
        if self._capturing is None:
            return False
        self._pending[self._capturing].append((weight, bias, x.detach(), grad.detach()))
        return True

    @torch.no_grad()
    def run(self, key: Any) -> None:
        """Compute and accumulate the weight gradients deferred under `key` (the W operation)."""
        for weight, bias, x, grad in self._pending.pop(key, []):
            flat_grad = grad.reshape(-1, grad.size(-1))
            _accumulate(weight, flat_grad.t().matmul(x.reshape(-1, x.size(-1))))
            if bias is not None:
                _accumulate(bias, flat_grad.sum(0))
            if self.on_accumulated is not None:
                self.on_accumulated(weight)
                if bias is not None:
                    self.on_accumulated(bias)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        dtype = _compute_dtype(x)
        x_c, w_c = x.to(dtype), weight.to(dtype)
        b_c = bias.to(dtype) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x_c, w_c, b_c)
        ctx.save_for_backward(x_c, w_c)
        ctx.params, ctx.store, ctx.input_dtype = (weight, bias), store, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        grad_input = grad.matmul(w).to(ctx.input_dtype)
        if ctx.store.defer(weight, bias, x, grad):
            return grad_input, None, None, None
        flat = grad.reshape(-1, grad.size(-1))
        grad_weight = flat.t().matmul(x.reshape(-1, x.size(-1))).to(weight.dtype)
        grad_bias = flat.sum(0).to(bias.dtype) if bias is not None else None
        return grad_input, grad_weight, grad_bias, None


def defer_weight_gradients(blocks: list[nn.Module], store: WeightGradStore) -> None:
    """Make the plain `nn.Linear` layers inside `blocks` deferrable."""
    for block in blocks:
        for module in block.modules():
            if type(module) is nn.Linear:
                for param in module.parameters():
                    param.grad_deferred = True  # type: ignore[attr-defined]  # W, not autograd, completes it
                module.forward = _deferrable_forward(module, store)  # type: ignore[method-assign]


def _deferrable_forward(linear: nn.Linear, store: WeightGradStore):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _DeferrableLinear.apply(x, linear.weight, linear.bias, store)
    return forward
