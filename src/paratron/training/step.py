"""One optimizer step over this rank's micro-batches, and evaluation.

The loss of a step is the mean over micro-batches of each micro-batch's mean token loss;
each micro-batch's backward is scaled by 1/num_micro_batches, and gradients are averaged
over data-parallel ranks, so every layout computes the gradient of the same global mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratron.optim.build import clip_grad_norm
from paratron.optim.mixed_precision import Precision
from paratron.parallel.data import DataParallel


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss of this rank's micro-batches (detached; not yet averaged over ranks). Under
    pipeline parallelism only the last stage knows it; the other stages hold zero."""
    grad_norm: torch.Tensor | None
    """Global gradient norm before clipping; None when the step was skipped."""
    skipped: bool
    """fp16 gradients overflowed somewhere: no rank stepped."""


def train_step(model: DataParallel, optimizer: torch.optim.Optimizer,
               batches: list[tuple[torch.Tensor, torch.Tensor]], precision: Precision,
               clip_grad: float) -> StepResult:
    model.zero_grad_buffer()
    if model.pipeline is not None:
        loss = model.pipeline.train_step(batches, precision.backward)
    else:
        total = torch.zeros((), device=batches[0][0].device)
        for i, (inputs, labels) in enumerate(batches):
            model.require_grad_sync(i == len(batches) - 1)
            logits = model(inputs)
            micro_loss = model.loss_function(logits, labels)
            precision.backward(micro_loss / len(batches))
            total += micro_loss.detach()
        loss = total / len(batches)
    model.finish_grad_sync()
    if hasattr(optimizer, "prepare_grads"):  # the distributed optimizer takes its shard of the result
        optimizer.prepare_grads()
    # whole gradients on the model, or this rank's shards on the distributed optimizer
    holder = optimizer if hasattr(optimizer, "gradients_for_norm") else model
    grads, weights, group = holder.gradients_for_norm()
    overflow = precision.unscale(grads, group)
    grad_norm = None
    if not overflow:
        grad_norm = clip_grad_norm(grads, clip_grad, group, weights)
        optimizer.step()
    precision.update(overflow)
    return StepResult(loss, grad_norm, skipped=overflow)


@torch.no_grad()
def evaluate_batches(model: DataParallel, batches: list[tuple[torch.Tensor, torch.Tensor]],
                     precision: Precision) -> torch.Tensor:
    """Mean loss over the given micro-batches (this rank's share of the evaluation; zero on
    pipeline stages other than the last)."""
    was_training = model.training
    model.eval()
    if model.pipeline is not None:
        mean = model.pipeline.evaluate(batches)
    else:
        total = torch.zeros((), device=batches[0][0].device)
        for inputs, labels in batches:
            total += model.loss_function(model(inputs), labels)
        mean = total / len(batches)
    model.train(was_training)
    return mean
