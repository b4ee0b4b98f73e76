"""The optimizer of a parallel model, learning-rate setting and global-norm clipping."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paratron.config.schema import OptimizerConfig
from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.optim.distributed import DistributedOptimizer
from paratron.optim.master_weights import FullyShardedOptimizer, MasterWeightsOptimizer, ReplicatedOptimizer
from paratron.parallel.model import ParallelModel

DECOUPLED_LR_PARAMETERS = ("embedding.weight", "output.weight")
"""The parameters --decoupled-lr applies to: the word embedding and the output layer (Megatron-LM's
`is_embedding_or_output_parameter`; not the learned position embedding)."""


def build_optimizer(model: ParallelModel, config: OptimizerConfig) -> MasterWeightsOptimizer:
    """The optimizer of `model`'s ZeRO stage: the distributed optimizer at stages 1 and 2, one
    over FSDP2's shards at stage 3, one over the whole model part otherwise."""
    decoupled = embedding_and_output(model.module) if config.decoupled_lr is not None else frozenset()
    if model.flat_parameters:
        return DistributedOptimizer(model.flat_parameters, config, model.norm_group, model.norm_weight, decoupled)
    if model.gradients.reducer is None:
        return FullyShardedOptimizer(model.trained_parameters, config, model.norm_group, model.norm_weight, decoupled)
    return ReplicatedOptimizer(
        model.trained_parameters, model.gradients.main_grad, config, model.norm_group, model.norm_weight, decoupled
    )


def embedding_and_output(module: nn.Module) -> frozenset[int]:
    """Ids of the word embedding and output layer weights this rank holds (a tied pair counts once)."""
    return frozenset(id(p) for name, p in module.named_parameters() if name in DECOUPLED_LR_PARAMETERS)


def clip_grad_norm(
    grads: Iterable[torch.Tensor], max_norm: float, group: RankGroup | None = None, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Global L2 norm of the whole model's gradients; scales `grads` down to `max_norm` when
    larger (max_norm 0: measure only). Returns the norm before clipping.

    When this rank holds only part of the gradients (tensor or pipeline shards, or data-parallel
    shards of the distributed optimizer), the squared norms are summed over `group`, each tensor
    scaled by its entry of `weights` (see `sharding.grad_norm_weight`) so that a tensor held by
    several ranks counts once."""
    grads = list(grads)
    if weights is None:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    else:
        squared = torch.zeros((), device=weights.device)
        if grads:
            norms = torch.stack(torch._foreach_norm(grads))
            squared = (weights * norms.float().pow(2)).sum()
        comm.all_reduce(squared, group or RankGroup.solo())
        norm = squared.sqrt()
    if max_norm > 0 and grads:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return norm
