"""The optimizer, with weight decay on matrices and embeddings only, and global-norm clipping."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from paratron.distributed import comm

from paratron.config.schema import OptimizerConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: tensors of two or more dims decay; biases and norm weights do not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    groups = parameter_groups(model, config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, group: Any = None,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients of the whole model; scales them down to `max_norm` when
    larger (max_norm 0: measure only). Returns the norm before clipping.

    When the model is split over a model-parallel `group` (tensor x pipeline ranks), the
    squared norms of the ranks' gradients are summed over it, each tensor scaled by its entry
    of `weights` (one per parameter, see `sharding.grad_norm_weight`) so that a tensor held by
    several ranks counts once."""
    params = list(params)
    grads = [p.grad for p in params]
    if weights is None:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    else:
        norms = torch.stack(torch._foreach_norm(grads))
        squared = (weights * norms.float().pow(2)).sum()
        comm.all_reduce(squared, group)
        norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
