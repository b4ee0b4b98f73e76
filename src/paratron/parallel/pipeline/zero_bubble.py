"""Splitting a backward pass into input gradients (B) and weight gradients (W).

Zero-bubble schedules run B as soon as possible, because the previous stage waits for its
result, and W later, where the rank would otherwise idle. The plain linear layers of the
transformer blocks (nearly all of a block's weight-gradient work) are swapped for a
`DeferringLinear` (same parameters, same names) whose backward returns only the input
gradient while a `WeightGradStore` is capturing; it stores the layer input and output
gradient instead, and W computes grad_W = g^T x from them. All other parameters (norms,
embeddings, the output layer, tensor-parallel layers) get their gradients in B, as usual.

Inside a compiled block (--compile) the same linear is a custom operator whose backward, traced into
the block's backward graph, gives the input gradient and calls a second operator, opaque to the
compiler and kept for its side effect, that stores (or, outside a capture, accumulates) the weight
gradient's inputs when the compiled backward runs: the graph is traced once, and which B captures
is decided each time it runs. The layer is named to that operator by a number in a CPU tensor, an
input of the graph, so equal blocks still share one graph.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratron.model.fused_linear import autocast_off, matmul_dtype
from paratron.parallel.sharding import update_info


class WeightGradStore:
    """Deferred weight-gradient work, per (micro-batch, chunk)."""

    def __init__(self) -> None:
        self._capturing: Any = None
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

    @property
    def capturing(self) -> bool:
        return self._capturing is not None

    def defer(self, weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, grad: torch.Tensor) -> bool:
        if self._capturing is None:
            return False
        self._pending[self._capturing].append((weight, bias, x.detach(), grad.detach()))
        return True

    @torch.no_grad()
    def run(self, key: Any, accumulated: Callable[[nn.Parameter], None]) -> None:
        """Compute and accumulate the weight gradients deferred under `key` (the W operation);
        `accumulated(param)` is told of each gradient completed (autograd's hook fired in B,
        before it existed)."""
        for weight, bias, x, grad in self._pending.pop(key, []):
            _accumulate_weight_gradients(weight, bias, x, grad)
            for param in (weight, bias):
                if param is not None:
                    accumulated(param)


@torch.no_grad()
def _accumulate_weight_gradients(weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, grad: torch.Tensor):
    """Add a linear's weight (and bias) gradient, from its input x and output gradient, to their .grad."""
    flat_grad = grad.reshape(-1, grad.size(-1))
    _accumulate(weight, flat_grad.t().matmul(x.reshape(-1, x.size(-1))))
    if bias is not None:
        _accumulate(bias, flat_grad.sum(0))


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        dtype = matmul_dtype(x)
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


_LAYERS: weakref.WeakValueDictionary[int, DeferringLinear] = weakref.WeakValueDictionary()
"""The deferring linears by number: what the compiled backward's weight-gradient operator is told."""
_NUMBERS = itertools.count()


@torch.library.custom_op("paratron::deferrable_linear", mutates_args=())
def _deferrable_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: torch.Tensor
) -> torch.Tensor:
    """F.linear of operands already in the matmul's type (no gradient reaches weight and bias: see below)."""
    with autocast_off(x):
        return F.linear(x, weight, bias)


@_deferrable_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.size(0)))


@torch.library.custom_op("paratron::weight_gradient", mutates_args=())
def _weight_gradient(x: torch.Tensor, grad: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """Layer number `layer`'s weight gradient from its input and output gradient: stored for W while its
    store captures, accumulated now otherwise. Returns nothing of use (an empty tensor)."""
    linear = _LAYERS[int(layer)]
    if linear.store.capturing:  # (copies: the compiler may reuse the graph's buffers after the last use it sees)
        linear.store.defer(linear.weight, linear.bias, x.clone(), grad.clone())
    else:
        _accumulate_weight_gradients(linear.weight, linear.bias, x, grad)
    return grad.new_empty(0)


@_weight_gradient.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(0)


torch.fx.node.has_side_effect(torch.ops.paratron.weight_gradient.default)  # (its result is unused: keep the call)


def _save_operands(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, _, layer = inputs
    ctx.save_for_backward(x, weight, layer)


def _input_gradient(ctx: Any, grad: torch.Tensor) -> tuple:
    x, weight, layer = ctx.saved_tensors
    torch.ops.paratron.weight_gradient(x, grad, layer)
    return grad.matmul(weight), None, None, None


_deferrable_linear.register_autograd(_input_gradient, setup_context=_save_operands)


class DeferringLinear(nn.Module):
    """An `nn.Linear`'s parameters (the same objects, under the same names) with a backward whose
    weight gradients `store` may defer to the W operation."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.store = store
        number = next(_NUMBERS)
        _LAYERS[number] = self
        self.number = torch.tensor(number, device="cpu")  # (not a buffer: it stays on the CPU, out of checkpoints)
        for param in (self.weight, self.bias):
            if param is not None:
                update_info(param, deferred_grad=True)  # W, not autograd, completes its gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return _DeferrableLinear.apply(x, self.weight, self.bias, self.store)
        dtype = matmul_dtype(x)
        weight, bias = self.weight.detach().to(dtype), self.bias.detach().to(dtype) if self.bias is not None else None
        return _deferrable_linear(x.to(dtype), weight, bias, self.number)


def defer_weight_gradients(blocks: list[nn.Module], store: WeightGradStore) -> None:
    """Swap the plain `nn.Linear` layers inside `blocks` for `DeferringLinear`s over `store`."""
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child.weight.requires_grad:  # (not a frozen base layer)
                    setattr(parent, name, DeferringLinear(child, store))
