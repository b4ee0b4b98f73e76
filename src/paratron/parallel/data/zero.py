"""The distributed optimizer (ZeRO stages 1 and 2): each data-parallel rank keeps the master
weights and optimizer state of its shard of every gradient bucket, and only those.

After backward the gradients are reduce-scattered (`buckets.GradientReducer`), so each rank
holds the data-parallel mean of its shard; it steps that shard with an ordinary PyTorch
optimizer over one tensor per parameter piece, writes the result into the flat parameter
buffer, and the buckets are all-gathered back (`DataParallel.start_param_gather`). The update
of every element is the one the single-device optimizer makes: AdamW works element by element,
and weight decay follows the parameter a piece belongs to.

Master weights are views into the parameter buffer when the parameters are fp32 (no copy, as
in Megatron-LM), and fp32 copies otherwise (bf16/fp16 training); gradients are fp32 either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratron.config.schema import OptimizerConfig
from paratron.optim.mixed_precision import MasterWeightsOptimizer, make_inner_optimizer
from paratron.parallel.data.ddp import DataParallel
from paratron.parallel.sharding import grad_norm_weight


class DistributedOptimizer(MasterWeightsOptimizer):
    """Optimizer-shaped (param_groups, step, state_dict, load_state_dict) over this rank's shards;
    its state dict holds this rank's shard only (it resumes at the same data-parallel layout)."""

    def __init__(self, model: DataParallel, config: OptimizerConfig) -> None:
        reducer = model.reducer
        if reducer is None or model.param_buffer is None:
            raise ValueError("the distributed optimizer needs a model wrapped with zero_stage 1 or 2")
        self.model, self.reducer = model, reducer
        self.pieces: list[tuple[nn.Parameter, int, int, int]] = reducer.local_pieces()
        self.masters, self.targets = [], []
        decay, no_decay = [], []
        for param, a, z, position in self.pieces:
            view = model.param_buffer[position:position + z - a]
            # (nn.Parameter aliases the view's storage: an fp32 master is the parameter shard itself)
            master = nn.Parameter(view if view.dtype == torch.float32 else view.detach().float())
            self.masters.append(master)
            self.targets.append(view)
            (decay if param.dim() >= 2 else no_decay).append(master)
        groups = [{"params": decay, "weight_decay": config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]] or [{"params": [], "weight_decay": 0.0}]
        self.optimizer = make_inner_optimizer(groups, config)
        weights = [grad_norm_weight(param, model.tp_size) for param, *_ in self.pieces]
        self.norm_weights = torch.tensor(weights, device=reducer.device) if weights else None
        self.prepare_grads()

    def prepare_grads(self) -> None:
        """Give each master its piece of the reduced gradient shard: a view when the dtypes agree,
        an fp32 copy otherwise. Call once per step, after the reduction and before unscaling and
        clipping (which then act on what `step` uses)."""
        reducer = self.reducer
        for master, (param, a, z, position) in zip(self.masters, self.pieces):
            if reducer.grad_buffer is not None:
                grad = reducer.grad_buffer[position:position + z - a]
            else:
                start = reducer.shard_position(position)
                grad = reducer.grad_shard[start:start + z - a]
            master.grad = grad if grad.dtype == master.dtype else grad.float()

    def gradients_for_norm(self) -> tuple[list[torch.Tensor], torch.Tensor | None, Any]:
        """This rank's shard pieces (disjoint over data-parallel ranks), weights, and the group of all ranks."""
        return [m.grad for m in self.masters], self.norm_weights, self.model.norm_group

    @torch.no_grad()
    def step(self) -> None:
        super().step()
        self.model.start_param_gather()
