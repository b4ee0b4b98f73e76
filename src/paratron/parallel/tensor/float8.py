"""fp8 twins of the tensor-parallel linear layers (--fp8-format at TP > 1).

The plain layers run their matmuls inside paratron's own autograd functions, which fuse the
communication with them; an fp8 matmul is torchao's own autograd function (its casts, scales and
scaled matmuls forward and backward). So the twins take Megatron-LM's textbook form instead: the
communication as autograd collectives around the fp8 matmul.

    column-parallel   x -> gather the sequence shards (SP) or copy (backward: all-reduce) -> x W_i^T + b_i
    row-parallel      x_i W_i^T -> reduce-scatter to sequence shards (SP) or all-reduce -> + b

A twin is the same module retyped (`retype`, as FSDP2 retypes the modules it shards): the same
parameters under the same names, its shards and checkpoints unchanged. With tensorwise scaling each
rank scales its own shard of a weight, so results differ from one device within fp8's rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paratron.distributed import comm
from paratron.parallel.tensor.layers import (
    ColumnParallelLinear,
    ColumnParallelProjections,
    RowParallelLinear,
    enter_column_region,
)

Float8Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(input, weight [out, in]) -> input @ weight^T through fp8 casts (torchao's)."""


class Float8ColumnParallelLinear(ColumnParallelLinear):
    """`ColumnParallelLinear` with its matmul in fp8 (no LoRA adapter: adapters stay in bf16)."""

    float8_matmul: Float8Matmul

    def local(self, total: torch.Tensor) -> torch.Tensor:
        """This rank's output rows from the whole input."""
        out = self.float8_matmul(total, self.weight)
        return out + self.bias.to(out.dtype) if self.bias is not None else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(enter_column_region(x, self.tp))


class Float8ColumnParallelProjections(ColumnParallelProjections):
    """`ColumnParallelProjections` gathering its input once for its fp8 projections."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        total = enter_column_region(x, self.tp)
        return tuple(linear.local(total) for linear in self.values())


class Float8RowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` with its partial matmul in fp8."""

    float8_matmul: Float8Matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.float8_matmul(x, self.weight)
        if self.tp.sequence_parallel:
            out = comm.reduce_scatter_to_sequence(partial, self.tp.group)
        else:
            out = comm.reduce_from_region(partial, self.tp.group)
        return out + self.bias.to(out.dtype) if self.bias is not None else out


FP8_TWINS: dict[type, type] = {
    ColumnParallelLinear: Float8ColumnParallelLinear,
    ColumnParallelProjections: Float8ColumnParallelProjections,
    RowParallelLinear: Float8RowParallelLinear,
}


def retype(module: nn.Module, float8_matmul: Float8Matmul | None = None) -> None:
    """Turn a tensor-parallel layer into its fp8 twin in place (its class swapped, nothing else)."""
    module.__class__ = FP8_TWINS[type(module)]
    if float8_matmul is not None:
        module.float8_matmul = float8_matmul
