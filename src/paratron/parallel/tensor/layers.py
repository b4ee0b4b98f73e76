"""Tensor-parallel twins of nn.Linear and nn.Embedding (Megatron-LM's layers).

- `ColumnParallelLinear`: the weight's output rows are split over the TP ranks; the input is
  whole (or, under sequence parallelism, gathered from sequence shards) and each rank
  produces its slice of the output features.
- `RowParallelLinear`: the weight's input columns are split; each rank multiplies its slice
  of the features and the partial outputs are summed (all-reduce, or reduce-scatter into
  sequence shards under sequence parallelism); the bias is added after the sum.
- `VocabParallelEmbedding`: the vocabulary rows are split; each rank looks up the ids it
  owns and zeros the rest, and the ranks' results are summed.

Parameters keep the names of the layers they replace, carry a `Shard` tag (see
`parallel/sharding.py`) and stay frozen when the replaced ones were (`requires_grad`);
gradients of frozen weights are never computed. Communication comes from `distributed/comm.py`.

LoRA adapters (`model/lora.py`: y = x W^T + s (x A^T) B^T) are split with their base layer and
add no collective:

    layer            A [rank, in]                     B [out, rank]
    column-parallel  whole; gradient partial over TP  rows split like W (replicated k/v heads alike)
    row-parallel     columns split like W             whole; gradient partial over TP

Column-parallel: h = x A^T is one more output of the base layer's matmuls, so their one input
gather and one input-gradient reduction cover it; each rank's gradient of h sees only its rows
of B. Row-parallel: the local s (x_i A_i^T) B^T joins the partial output before the layer's sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.model.fused_linear import (
    autocast_off,
    cast_operands,
    linears,
    stacked_input_grad,
    stacked_linear,
    stacked_param_grads,
)
from paratron.model.lora import LoRALinear
from paratron.parallel.sharding import Shard, set_partial_grad, set_shard


@dataclass(frozen=True)
class TPContext:
    """Where this rank sits in its tensor-parallel group. Without a group (None) only shapes and
    slices are worked out (planning on the meta device): nothing can be communicated."""

    size: int
    rank: int
    group: RankGroup | None = None
    sequence_parallel: bool = False


def enter_column_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """The whole input of work split by output columns: the sequence shards gathered under sequence parallelism
    (backward: reduce-scatter), else x itself (backward: the ranks' input gradients summed)."""
    if tp.sequence_parallel:
        return comm.gather_from_sequence(x, tp.group)
    return comm.copy_to_region(x, tp.group)


class ColumnRegionEntry(nn.Module):
    """`enter_column_region` as a module: where a kind's plan marks an identity `ColumnInput` (an activation that
    per-head work uses without a column-parallel layer in between)."""

    def __init__(self, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return enter_column_region(x, self.tp) if self.tp.group is not None else x


class _ColumnParallelMatmuls(torch.autograd.Function):
    """[x W_1^T + b_1, x W_2^T + b_2, ...] side by side for this rank's rows of one or more weights
    sharing the input x (queries, keys and values; gate and up; LoRA A matrices, without bias), as one
    matmul over their concatenated rows (`model/fused_linear.py`; one more each for the input and
    weight gradients in backward). x is replicated, or
    sequence-sharded and gathered here. In backward, one all-reduce (or reduce-scatter) of the
    summed input gradient is launched asynchronously and overlaps the weight-gradient matmuls.
    Under sequence parallelism only the local shard of x is kept for backward, where it is
    gathered again while the input gradient is computed (Megatron-LM's trade of one all-gather
    for 1/TP of the activation memory). Gradients autograd does not ask for (frozen weights, an
    input that needs none) are neither computed nor communicated: every tensor-parallel rank
    asks for the same ones, so the ranks skip the same collectives."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, *weights_and_biases):
        dtype, weights, biases = cast_operands(ctx, x, weights_and_biases)
        local = x.to(dtype)
        total = comm.all_gather(local, 1, group) if sequence_parallel else local
        with autocast_off(x):
            stacked = stacked_linear(total, weights, biases)
        ctx.save_for_backward(local, *weights)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        return stacked

    @staticmethod
    def backward(ctx, grad):
        local, *weights = ctx.saved_tensors
        wanted = ctx.needs_input_grad[3:]  # (weight, bias) pairs
        gather = None
        total = local
        if ctx.sequence_parallel and any(wanted):
            total, gather = comm.all_gather(local, 1, ctx.group, async_op=True)
        grad = grad.contiguous()
        grad_input = stacked_input_grad(grad, weights) if ctx.needs_input_grad[0] else None
        if gather is not None:
            gather.wait()
        work = None
        if grad_input is not None:
            grad_input, work = _reduce_input_grad(grad_input, ctx.group, ctx.sequence_parallel)
        param_grads = stacked_param_grads(grad, total, weights, wanted, ctx.has_bias, ctx.param_dtypes)
        if work is not None:
            work.wait()
        grad_input = grad_input.to(ctx.input_dtype) if grad_input is not None else None
        return (grad_input, None, None, *param_grads)


def _reduce_input_grad(grad_input: torch.Tensor, group: RankGroup, sequence_parallel: bool) -> tuple:
    """Launch the sum of the ranks' input gradients (into sequence shards under sequence
    parallelism): (the result, its work handle)."""
    if sequence_parallel:
        return comm.reduce_scatter(grad_input, 1, group, async_op=True)
    return grad_input, comm.all_reduce(grad_input, group, async_op=True)


def _column_shard(out_features: int, tp: TPContext, rows_per_unit: int, units: int | None) -> Shard:
    """This rank's rows, in whole units (heads of `rows_per_unit` rows). With fewer units than
    ranks (key/value heads under GQA when TP exceeds them) each unit is replicated on
    size // units consecutive ranks."""
    units = units or out_features // rows_per_unit
    if units % tp.size == 0:
        per_rank = units // tp.size
        return Shard(0, tp.rank * per_rank * rows_per_unit, per_rank * rows_per_unit, out_features)
    replicas = tp.size // units
    return Shard(0, (tp.rank // replicas) * rows_per_unit, rows_per_unit, out_features, duplicates=replicas)


def _layout(tp: TPContext, shard_of_rank: Callable[[TPContext], Shard]) -> tuple[Shard, ...]:
    """Every tensor-parallel rank's slice, computed alike on every rank."""
    return tuple(shard_of_rank(TPContext(tp.size, rank)) for rank in range(tp.size))


def _copy_trainable(source: nn.Module, target: nn.Module) -> None:
    """Keep frozen what was frozen: each of `target`'s own parameters takes `requires_grad` from
    the parameter of the same name in `source` (the layer it replaces)."""
    for name, param in target.named_parameters(recurse=False):
        original = getattr(source, name, None)
        if isinstance(original, torch.Tensor):
            param.requires_grad_(original.requires_grad)


class ColumnParallelLinear(nn.Module):
    """This rank's output rows of a linear layer (and of its LoRA adapter's B, with A whole)."""

    def __init__(
        self,
        in_features: int,
        rows: int,
        bias: bool,
        tp: TPContext,
        layout: tuple[Shard, ...],
        device: torch.device | str | None = None,
        adapter: tuple[int, float] | None = None,
    ) -> None:
        """`adapter` = (rank, scaling) of a LoRA adapter to split with the weight (None: none)."""
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(rows, in_features, device=device))
        self.bias = nn.Parameter(torch.empty(rows, device=device)) if bias else None
        set_shard(self.weight, layout, tp.rank)
        if self.bias is not None:
            set_shard(self.bias, layout, tp.rank)  # dimension 0 of both
        self.register_parameter("lora_a", None)
        self.register_parameter("lora_b", None)
        self.scaling = 0.0
        if adapter is not None:
            rank, self.scaling = adapter
            self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device))
            self.lora_b = nn.Parameter(torch.empty(rows, rank, device=device))
            set_shard(self.lora_b, layout, tp.rank)
            # each rank's gradient of h = x A^T sees only its rows of B
            set_partial_grad(self.lora_a, tp.group)

    @classmethod
    def split(
        cls, linear: nn.Linear, tp: TPContext, rows_per_unit: int = 1, units: int | None = None
    ) -> ColumnParallelLinear:
        layout = _layout(tp, lambda t: _column_shard(linear.out_features, t, rows_per_unit, units))
        adapter = (linear.rank, linear.scaling) if isinstance(linear, LoRALinear) else None
        twin = cls(
            linear.in_features,
            layout[tp.rank].length,
            linear.bias is not None,
            tp,
            layout,
            linear.weight.device,
            adapter,
        )
        _copy_trainable(linear, twin)
        return twin

    def matmul_inputs(self) -> list[torch.Tensor | None]:
        """This layer's (weight, bias) pairs for `_ColumnParallelMatmuls`: W and b, then A (no bias)."""
        if self.lora_a is None:
            return [self.weight, self.bias]
        return [self.weight, self.bias, self.lora_a, None]

    def output_sizes(self) -> list[int]:
        """The widths of this layer's outputs among `_ColumnParallelMatmuls`' stacked ones: W's rows, then A's."""
        return [self.weight.size(0)] + ([self.lora_a.size(0)] if self.lora_a is not None else [])

    def combine(self, outputs: Iterator[torch.Tensor]) -> torch.Tensor:
        """This layer's output from the next of `_ColumnParallelMatmuls`' outputs: x W^T + b,
        plus s h B^T from h = x A^T when it has an adapter."""
        out = next(outputs)
        if self.lora_a is None:
            return out
        return out + self.scaling * F.linear(next(outputs), self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.group is None:
            stacked = linears(x, self.matmul_inputs())
        else:
            stacked = _ColumnParallelMatmuls.apply(x, self.tp.group, self.tp.sequence_parallel, *self.matmul_inputs())
        return self.combine(iter(stacked.split(self.output_sizes(), dim=-1)))


class ColumnParallelProjections(nn.ModuleDict):
    """`Projections` split by rows: several column-parallel linears of one input, computed with a
    single input gather and a single gradient reduction."""

    def __init__(self, projections: nn.ModuleDict, tp: TPContext, units: dict[str, tuple[int, int]]) -> None:
        """`units[name]` = (rows per unit, number of units) for each projection (e.g. heads)."""
        super().__init__(
            {
                name: ColumnParallelLinear.split(linear, tp, *units.get(name, (1, None)))
                for name, linear in projections.items()
            }
        )
        self.tp = tp

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.tp.group is None:
            return tuple(linear(x) for linear in self.values())
        params = [p for linear in self.values() for p in linear.matmul_inputs()]
        stacked = _ColumnParallelMatmuls.apply(x, self.tp.group, self.tp.sequence_parallel, *params)
        outputs = iter(stacked.split([size for linear in self.values() for size in linear.output_sizes()], dim=-1))
        return tuple(linear.combine(outputs) for linear in self.values())


class RowParallelLinear(nn.Module):
    """This rank's input columns of a linear layer (and of its LoRA adapter's A, with B whole)."""

    def __init__(self, linear: nn.Linear, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        per_rank = linear.in_features // tp.size
        device = linear.weight.device
        self.weight = nn.Parameter(torch.empty(linear.out_features, per_rank, device=device))
        self.bias = nn.Parameter(torch.empty(linear.out_features, device=device)) if linear.bias is not None else None
        layout = _layout(tp, lambda t: Shard(1, t.rank * per_rank, per_rank, linear.in_features))
        set_shard(self.weight, layout, tp.rank)
        if self.bias is not None and tp.sequence_parallel:
            set_partial_grad(self.bias, tp.group)  # added on a sequence shard: each rank sees part
        self.register_parameter("lora_a", None)
        self.register_parameter("lora_b", None)
        self.scaling = 0.0
        if isinstance(linear, LoRALinear):
            self.scaling = linear.scaling
            self.lora_a = nn.Parameter(torch.empty(linear.rank, per_rank, device=device))
            self.lora_b = nn.Parameter(torch.empty(linear.out_features, linear.rank, device=device))
            set_shard(self.lora_a, layout, tp.rank)  # dimension 1 of both
            set_partial_grad(self.lora_b, tp.group)  # each rank's h = x_i A_i^T is a partial sum
        _copy_trainable(linear, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.lora_a is not None:  # (summed with the base layer's partial output: one collective)
            partial = partial + self.scaling * F.linear(F.linear(x, self.lora_a), self.lora_b)
        if self.tp.sequence_parallel:
            out = comm.reduce_scatter_to_sequence(partial, self.tp.group)
        else:
            out = comm.reduce_from_region(partial, self.tp.group)
        return out + self.bias if self.bias is not None else out


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int) -> int:
    """The rows of the embedding and output layer over all TP ranks: the vocabulary rounded up to a multiple of
    divisible_by x TP (Megatron-LM's --make-vocab-size-divisible-by), at every TP size, one rank included, so that
    each rank's slice of the output matmul has a shape the hardware runs at full speed (GPT-2's 50,257 words are
    50,304 rows at the default 128). divisible_by 1 pads only to a multiple of TP. Padding rows are zero, never
    predicted, never trained, and left out of checkpoints."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def vocab_shard(vocab_size: int, tp: TPContext, divisible_by: int) -> Shard:
    per_rank = padded_vocab_size(vocab_size, tp.size, divisible_by) // tp.size
    start = tp.rank * per_rank
    return Shard(0, start, max(0, min(per_rank, vocab_size - start)), vocab_size)


class VocabParallelEmbedding(nn.Module):
    """The embedding table over this rank's vocabulary rows (padding rows beyond the real vocabulary are zero and
    never looked up). On a single rank it holds the whole padded table and is a plain lookup."""

    def __init__(self, embedding: nn.Embedding, tp: TPContext, divisible_by: int) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = embedding.num_embeddings
        self.rows = padded_vocab_size(self.vocab_size, tp.size, divisible_by) // tp.size
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding.embedding_dim, device=embedding.weight.device))
        set_shard(self.weight, _layout(tp, lambda t: vocab_shard(self.vocab_size, t, divisible_by)), tp.rank)
        _copy_trainable(embedding, self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # (every id is this rank's)
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.start + self.rows)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp.sequence_parallel:
            return comm.reduce_scatter_to_sequence(out, self.tp.group)
        return comm.reduce_from_region(out, self.tp.group)


class VocabParallelOutput(ColumnParallelLinear):
    """The output layer over this rank's vocabulary rows. Logits of padding rows (beyond the
    real vocabulary) are -inf, so they are never predicted and get no gradient. On a single rank,
    which holds the whole vocabulary, the matmul runs over the padded rows and only the real
    vocabulary's logits are returned: the loss, its gradients and sampling are the unpadded model's."""

    def __init__(self, output: nn.Linear, tp: TPContext, divisible_by: int) -> None:
        layout = _layout(tp, lambda t: vocab_shard(output.out_features, t, divisible_by))
        rows = padded_vocab_size(output.out_features, tp.size, divisible_by) // tp.size
        super().__init__(output.in_features, rows, False, tp, layout, output.weight.device)
        self.valid_rows = layout[tp.rank].length
        _copy_trainable(output, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight)[..., : self.valid_rows]
        logits = super().forward(x)
        if self.valid_rows < logits.size(-1):
            padding = torch.arange(logits.size(-1), device=logits.device) >= self.valid_rows
            logits = logits.masked_fill(padding, float("-inf"))
        return logits


class SequenceShardedEmbedding(nn.Embedding):
    """A replicated table (learned positions) whose output is cut to this rank's sequence shard."""

    def __init__(self, embedding: nn.Embedding, tp: TPContext) -> None:
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, device=embedding.weight.device)
        self.tp = tp
        _copy_trainable(embedding, self)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """`positions` [T] (shared by every row) or [B, T] (packed sequences); the sequence is the last dimension."""
        return comm.scatter_to_sequence(super().forward(positions), self.tp.group, dim=positions.dim() - 1)
