"""Several linear maps of one input as one matmul: queries, keys and values; an MLP's gate and up
projections; a LoRA adapter's A beside its base weight.

The model keeps each map its own parameter (`layers.{i}.attention.in_proj.{q,k,v}`, as checkpoints,
converters and adapters name them); the weights are concatenated by rows for each step's matmul
instead. Concatenating costs O(rows x in) copies against the matmul's O(tokens x rows x in) work,
and one wide matmul keeps a GPU busier than three narrow ones. Backward is one matmul for the input
gradient and one for the weight gradients (of the trainable weights only), split afterwards.

An engine that owns its model lays each group's weights out one after another in one storage
(`lay_out_stacked`): the concatenation is then a view, free, which a one-token decoding step would
otherwise pay in full for every layer. The parameters stay the same objects with the same values.

Outside autograd, a CPU computes a linear map of a few rows (a decoding step's: one per sequence) up to twice as
fast as (W x^T)^T for some weight shapes and row counts (the BLAS splits W's rows over the threads, where x W^T of a
few rows may run on one), and slower for others: `few_row_linear` measures both once per weight shape and power of
two of rows (`FewRowChoices`) and keeps the faster.

Only the individual weights are kept for backward (not their concatenation, which would hold a
second copy of the weights until then); backward concatenates them again. The same arithmetic
serves the tensor-parallel twin (`parallel/tensor/layers.py`), which adds its collectives around it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The type a matmul of `x` runs in: autocast's when it is on, else x's own."""
    device_type = x.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def autocast_off(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """No autocast inside (the types are chosen already); nothing to turn off where it is not on (the meta device
    has none)."""
    device_type = x.device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def cast_operands(ctx: Any, x: torch.Tensor, weights_and_biases: Sequence[torch.Tensor | None]) -> tuple:
    """(the matmul's type, the weights, the biases) with the weights and biases cast to the type a matmul of `x`
    runs in (`matmul_dtype`); notes on `ctx` what backward needs: which outputs have a bias, and each gradient's
    own type (the input's and the parameters')."""
    dtype = matmul_dtype(x)
    weights = [w.to(dtype) for w in weights_and_biases[0::2]]
    biases = [b.to(dtype) if b is not None else None for b in weights_and_biases[1::2]]
    ctx.has_bias = [b is not None for b in biases]
    ctx.input_dtype = x.dtype
    ctx.param_dtypes = [w.dtype for w in weights_and_biases[0::2]]
    return dtype, weights, biases


def _rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' concatenation by rows: a view when they already lie one after another in one storage."""
    if len(tensors) == 1:
        return tensors[0]
    joined = _adjacent_rows(tensors)
    return joined if joined is not None else torch.cat(list(tensors))


def _adjacent_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view over `tensors` if each starts in memory where the one before ends, all in the first one's storage
    (None otherwise, under compile, or where autograd watches them: a view of the first would not pass gradients to
    the others). Checked at each call, cheaply: a weight moved or replaced is never read from where it was."""
    first, last = tensors[0], tensors[-1]
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None  # (a compiled graph has its own memory plan: it concatenates)
    rest, dtype, step = first.shape[1:], first.dtype, first.element_size()
    address = first.data_ptr()
    for tensor in tensors:
        if tensor.data_ptr() != address or tensor.dtype != dtype or tensor.shape[1:] != rest:
            return None
        if not tensor.is_contiguous():
            return None
        address += tensor.numel() * step
    storage = first.untyped_storage()
    if storage.data_ptr() != last.untyped_storage().data_ptr():  # (memory is one allocation: all lie within)
        return None
    rows = sum(t.size(0) for t in tensors)
    return first.as_strided((rows, *rest), first.stride(), first.storage_offset())


def lay_out_stacked(params: Sequence[torch.Tensor]) -> None:
    """Move `params` (a group's weights, or its biases) into one storage, one after another, so that their
    concatenation is a view (`_rows`). Same parameters, same values; for a model only inference uses (a
    training run's parameters may live in its gradient or gather buffers, which this would leave)."""
    if len(params) < 2 or len({(p.dtype, p.device, p.shape[1:]) for p in params}) != 1:
        return
    joined = torch.cat([p.detach() for p in params])
    start = 0
    for param in params:
        param.data = joined[start : start + param.size(0)]
        start += param.size(0)


LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""x, W, b -> x W^T + b."""


class FewRowChoices:
    """For each (weight shape, type, power of two of rows up to `MOST_ROWS`): whether a CPU computes x W^T + b
    faster as (W x^T)^T + b. Measured the first time each is met (best of `TRIES` calls each way, the transposed
    way chosen only when `MARGIN` faster), then remembered for the process: the same machine, the same answer."""

    MOST_ROWS = 64
    TRIES = 3
    MARGIN = 0.9

    def __init__(self) -> None:
        self.transposed: dict[tuple[int, int, torch.dtype, int], bool] = {}

    def use_transposed(self, flat: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `flat` [rows, in] (2 to `MOST_ROWS` rows) times `weight` [out, in] runs faster transposed
        (measuring it if not known)."""
        key = (weight.size(0), weight.size(1), weight.dtype, 1 << (flat.size(0) - 1).bit_length())
        choice = self.transposed.get(key)
        if choice is None:
            plain = self._seconds(lambda: F.linear(flat, weight))
            turned = self._seconds(lambda: _transposed_product(flat, weight))
            choice = self.transposed[key] = turned < self.MARGIN * plain
        return choice

    def _seconds(self, run: Callable[[], torch.Tensor]) -> float:
        run()  # (warm: the first call of a shape allocates)
        best = float("inf")
        for _ in range(self.TRIES):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        return best


FEW_ROWS = FewRowChoices()
"""The process's measured choices (one machine: like cuDNN's benchmark cache, kept for the process's life)."""


def _transposed_product(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, flat.t()).t().contiguous()


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for inference (no autograd): a few rows on the CPU the faster way `FEW_ROWS` measured, the same
    values up to the order of the sums; everything else, and every run that asks for deterministic algorithms,
    F.linear's."""
    rows = x.numel() // max(x.size(-1), 1)
    if (
        not 1 < rows <= FewRowChoices.MOST_ROWS  # (first: a batch-1 decoding step's every call stops here)
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
        or torch.are_deterministic_algorithms_enabled()
        or torch.compiler.is_compiling()
        or x.dtype != weight.dtype
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.size(-1))
    if not FEW_ROWS.use_transposed(flat, weight):
        return F.linear(x, weight, bias)
    out = _transposed_product(flat, weight)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.size(0))


def stacked_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    linear: LinearFn = F.linear,
) -> torch.Tensor:
    """[x W_1^T + b_1, x W_2^T + b_2, ...] side by side in the last dimension, as one matmul over the
    weights' rows (a missing bias adds zeros to its rows only: x + 0 is x); by `linear` (inference: few_row_linear)."""
    bias = None
    if any(b is not None for b in biases):
        bias = _rows([b if b is not None else w.new_zeros(w.size(0)) for w, b in zip(weights, biases)])
    return linear(x, _rows(weights), bias)


def stacked_input_grad(grad: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The input's gradient, sum_i g_i W_i, as one matmul (`grad`: the stacked outputs' gradient)."""
    return grad.matmul(_rows(weights))


def stacked_param_grads(
    grad: torch.Tensor,
    total: torch.Tensor,
    weights: Sequence[torch.Tensor],
    wanted: Sequence[bool],
    has_bias: Sequence[bool],
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor | None]:
    """(weight, bias) gradients of each stacked output, None where autograd wants none (frozen
    weights, absent biases): the wanted weights' gradients as one matmul, split by rows."""
    if not any(wanted):
        return [None] * len(wanted)
    flat_input = total.reshape(-1, total.size(-1))
    flat = grad.reshape(-1, grad.size(-1))
    sizes = [w.size(0) for w in weights]
    columns = flat.split(sizes, dim=1)
    chosen = [i for i in range(len(weights)) if wanted[2 * i]]
    weight_grads: dict[int, torch.Tensor] = {}
    if len(chosen) == len(weights):
        weight_grads = dict(enumerate(flat.t().matmul(flat_input).split(sizes)))
    elif chosen:
        picked = torch.cat([columns[i] for i in chosen], dim=1) if len(chosen) > 1 else columns[chosen[0]]
        weight_grads = dict(zip(chosen, picked.t().matmul(flat_input).split([sizes[i] for i in chosen])))
    out: list[torch.Tensor | None] = []
    for i, (bias, dtype) in enumerate(zip(has_bias, dtypes)):
        out.append(weight_grads[i].to(dtype) if i in weight_grads else None)
        out.append(columns[i].sum(0).to(dtype) if bias and wanted[2 * i + 1] else None)
    return out


class StackedLinears(torch.autograd.Function):
    """[x W_i^T + b_i ...] side by side on one device, one matmul each way (see the module's doc).
    Arguments: x, then (weight, bias) pairs (bias None where there is none)."""

    @staticmethod
    def forward(ctx, x, *weights_and_biases):
        dtype, weights, biases = cast_operands(ctx, x, weights_and_biases)
        total = x.to(dtype)
        with autocast_off(x):
            out = stacked_linear(total, weights, biases)
        ctx.save_for_backward(total, *weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        total, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_input = stacked_input_grad(grad, weights).to(ctx.input_dtype) if ctx.needs_input_grad[0] else None
        wanted = ctx.needs_input_grad[1:]
        return (grad_input, *stacked_param_grads(grad, total, weights, wanted, ctx.has_bias, ctx.param_dtypes))


def linears(x: torch.Tensor, weights_and_biases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """[x W_1^T + b_1, x W_2^T + b_2, ...] side by side in the last dimension for (weight, bias)
    pairs: one matmul forward, one each for the input and weight gradients backward. Without autograd (inference)
    the same arithmetic runs without an autograd function's bookkeeping, a tenth of a decoding step's time."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return StackedLinears.apply(x, *weights_and_biases)
    dtype = matmul_dtype(x)
    if dtype == x.dtype and all(p is None or p.dtype == dtype for p in weights_and_biases):
        return stacked_linear(x, weights_and_biases[0::2], weights_and_biases[1::2], few_row_linear)
    weights = [w.to(dtype) for w in weights_and_biases[0::2]]
    biases = [b.to(dtype) if b is not None else None for b in weights_and_biases[1::2]]
    with autocast_off(x):
        return stacked_linear(x.to(dtype), weights, biases, few_row_linear)
