"""The optimizer, with weight decay on matrices and embeddings only, and global-norm clipping."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from paratron.distributed import comm

from paratron.config.schema import OptimizerConfig
from paratron.optim.mixed_precision import MixedPrecisionOptimizer, make_inner_optimizer


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: tensors of two or more dims decay; biases and norm weights do not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of a parallel model: the distributed optimizer under ZeRO stage 1 or 2; fp32
    master weights over 16-bit parameters (bf16/fp16 at stage 0); an ordinary one over fp32
    parameters otherwise (including FSDP's sharded fp32 parameters at stage 3)."""
    settings = getattr(model, "settings", None)
    if settings is not None and settings.zero_stage in (1, 2):
        from paratron.parallel.data.zero import DistributedOptimizer  # (parallel/ imports optim/)

        return DistributedOptimizer(model, config)  # type: ignore[return-value]
    if any(p.dtype != torch.float32 for p in model.parameters() if not hasattr(p, "to_local")):
        return MixedPrecisionOptimizer(model, config)  # type: ignore[return-value]
    return make_inner_optimizer(parameter_groups(model, config.weight_decay), config)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(grads: Iterable[torch.Tensor], max_norm: float, group: Any = None,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
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
        comm.all_reduce(squared, group)
        norm = squared.sqrt()
    if max_norm > 0 and grads:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return norm
