"""One optimizer step over this rank's micro-batches.

The loss of a step is the mean over micro-batches of each micro-batch's mean token loss;
each micro-batch's backward is scaled by 1/num_micro_batches, and gradients are averaged
over data-parallel ranks, so every layout computes the gradient of the same global mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratron.optim.build import clip_grad_norm
from paratron.optim.mixed_precision import Precision
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.model import Batch, ParallelModel


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss of this rank's micro-batches (detached; not yet averaged over ranks). Under
    pipeline parallelism only the last stage knows it; the other stages hold zero."""
    grad_norm: torch.Tensor | None
    """Global gradient norm before clipping; None when the step was skipped."""
    skipped: bool
    """fp16 gradients overflowed somewhere: no rank stepped."""


def train_step(
    model: ParallelModel, optimizer: TrainingOptimizer, batches: list[Batch], precision: Precision, clip_grad: float
) -> StepResult:
    model.zero_grad()
    loss = model.forward_backward(batches, precision.backward)  # gradients complete and averaged
    optimizer.prepare_grads()
    grads = optimizer.grads_for_norm()
    overflow = precision.unscale(grads.tensors, grads.group)
    grad_norm = None
    if not overflow:
        grad_norm = clip_grad_norm(grads.tensors, clip_grad, grads.group, grads.weights)
        optimizer.step()
        optimizer.after_step()
    precision.update(overflow)
    return StepResult(loss, grad_norm, skipped=overflow)
