"""One optimizer step over this rank's micro-batches.

Each micro-batch's loss is the sum of its token losses times a weight
(`ParallelModel.loss_weights`; MoE load-balancing losses are averaged over micro-batches), and
gradients are averaged over data-parallel ranks, so every layout (TP, PP, DP, ZeRO, the number
of micro-batches) computes the gradient of the same loss:

    default                 the mean over micro-batches of each micro-batch's mean token loss
                            (Megatron-LM's default; for pretraining without masks every
                            micro-batch holds as many trained tokens, and both are the same)
    per-token loss          the sum of the token losses of the whole global batch divided by its
                            trained tokens (--calculate-per-token-loss, the default with --sft:
                            a short conversation weighs no more per token than a long one)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratron.model.batch import Batch
from paratron.optim.build import clip_grad_norm
from paratron.optim.mixed_precision import Precision
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.model import ParallelModel
from paratron.training.expert_load import ExpertStats, take_expert_stats, update_expert_biases


@dataclass
class StepResult:
    loss: torch.Tensor
    """This rank's weighted loss (detached); its mean over data-parallel ranks is the step's loss.
    Under pipeline parallelism only the last stage knows it; the other stages hold zero."""
    grad_norm: torch.Tensor | None
    """Global gradient norm before clipping; None when the step was skipped."""
    skipped: bool
    """fp16 gradients overflowed somewhere: no rank stepped."""
    trained_tokens: torch.Tensor
    """Trained (unmasked) labels in this rank's micro-batches."""
    experts: ExpertStats | None = None
    """What this rank's MoE layers counted in the step (None without experts)."""
    nonfinite: bool = False
    """The gradient norm was NaN or infinite (every rank agrees: it is global): no rank stepped."""
    nonfinite_where: str = ""
    """Which module went non-finite first (filled in by the loop's diagnosis)."""


def train_step(
    model: ParallelModel,
    optimizer: TrainingOptimizer,
    batches: list[Batch],
    precision: Precision,
    clip_grad: float,
    per_token_loss: bool = False,
) -> StepResult:
    weights, trained = model.loss_weights(batches, per_token_loss)
    model.set_aux_loss_scale(precision.loss_scale / len(batches))  # MoE: the mean over micro-batches
    model.zero_grad()
    loss = model.forward_backward(batches, precision.backward, weights)  # gradients complete and averaged
    experts = take_expert_stats(model)
    optimizer.prepare_grads()
    grads = optimizer.grads_for_norm()
    overflow = precision.unscale(grads.tensors, grads.group)
    grad_norm, nonfinite = None, False
    if not overflow:
        grad_norm = clip_grad_norm(grads.tensors, clip_grad, grads.group, grads.weights)
        nonfinite = not bool(torch.isfinite(grad_norm))
        if not nonfinite:
            optimizer.step()
            optimizer.after_step()
            update_expert_biases(model, experts)
    precision.update(overflow)
    return StepResult(loss, grad_norm, overflow, trained, experts, nonfinite)
