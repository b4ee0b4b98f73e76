"""The distributed optimizer (ZeRO stages 1 and 2): each data-parallel rank keeps the master
weights and optimizer state of its shard of every gradient bucket, and only those (the experts'
buckets, under expert parallelism, are sharded over the expert-data-parallel ranks).

After backward the gradients are reduce-scattered (`parallel.data_parallel.buckets.GradientReducer`), so
each rank holds the data-parallel mean of its shard; it steps that shard with an ordinary
PyTorch optimizer over one tensor per parameter piece, writes the result into the flat
parameter buffer, and the buckets are all-gathered back (`parallel.data_parallel.param_gather`). The
update of every element is the one the single-device optimizer makes: AdamW works element by
element, and weight decay follows the parameter a piece belongs to.

Master weights are views into the parameter buffer when the parameters are fp32 (no copy, as
in Megatron-LM), and fp32 copies otherwise (bf16/fp16 training); the masters' gradients are fp32
either way (copies of the reduced shard where it is bf16: --grad-reduce-in-bf16).

The pieces step as separate tensors (with foreach or fused kernels, `master_weights.step_implementation`),
not as this rank's stretch of the flat buffer as one tensor, though AdamW's update is element-wise: the
pieces of one shard fall in different weight-decay groups (and decoupled learning rates), the state is
keyed by piece (checkpoints read it per parameter), and at the sizes that matter the step is bound by
memory traffic, which one tensor does not reduce (bench/optimizer_step.py: no faster at 124M parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from paratron.config.schema import OptimizerConfig
from paratron.distributed.topology import RankGroup
from paratron.optim.master_weights import MasterWeightsOptimizer, make_inner_optimizer, optimizer_groups
from paratron.optim.protocol import OptimizerPiece
from paratron.parallel.data_parallel.param_gather import FlatParameters


class DistributedOptimizer(MasterWeightsOptimizer):
    """The protocol over this rank's pieces of the flat parameters; its state dict holds this
    rank's shard only (checkpoints use `pieces`, which load at any layout)."""

    def __init__(
        self,
        flats: list[FlatParameters],
        config: OptimizerConfig,
        norm_group: RankGroup,
        norm_weight: Callable[[torch.Tensor], float],
        decoupled: Collection[int] = (),
    ) -> None:
        self.flats = flats
        self._pieces: list[tuple[FlatParameters, nn.Parameter, int, int, int]] = [
            (flat, *piece) for flat in flats for piece in flat.reducer.local_pieces()
        ]
        self.masters, self.targets = [], []
        for flat, _, a, z, position in self._pieces:
            view = flat.buffer[position : position + z - a]
            # (nn.Parameter aliases the view's storage: an fp32 master is the parameter shard itself)
            self.masters.append(nn.Parameter(view if view.dtype == torch.float32 else view.detach().float()))
            self.targets.append(view)
        params = [param for _, param, *_ in self._pieces]
        groups = [g for g in optimizer_groups(params, self.masters, config, decoupled) if g["params"]]
        self.optimizer = make_inner_optimizer(groups or [{"params": [], "weight_decay": 0.0}], config)
        # (always weighted, even over one rank: each piece's share of the norm is summed the same way)
        weights = [norm_weight(param) for param in params]
        self.norm_group = norm_group
        self.norm_weights = torch.tensor(weights, device=flats[0].reducer.device) if weights else None
        self.prepare_grads()

    def prepare_grads(self) -> None:
        """Give each master its piece of the reduced gradient shard: a view when the dtypes agree,
        an fp32 copy otherwise. Called once per step, after the reduction and before unscaling and
        clipping (which then act on what `step` uses)."""
        for master, (flat, _, a, z, position) in zip(self.masters, self._pieces):
            reducer = flat.reducer
            if reducer.grad_buffer is not None:
                grad = reducer.grad_buffer[position : position + z - a]
            else:
                start = reducer.shard_position(position)
                grad = reducer.grad_shard[start : start + z - a]
            master.grad = grad if grad.dtype == master.dtype else grad.float()
            self.copies_grads = self.copies_grads or grad.dtype != master.dtype

    def after_step(self) -> None:
        """Write this rank's updated pieces into the flat buffer, then gather every rank's."""
        self.write_back()
        for flat in self.flats:
            flat.start_gather()

    def pieces(self) -> list[OptimizerPiece]:
        return [
            OptimizerPiece(param, a, z, master, param.dtype != master.dtype)
            for master, (_, param, a, z, _) in zip(self.masters, self._pieces)
        ]
