"""One optimizer step over this rank's micro-batches, and evaluation.

The loss of a step is the mean over micro-batches of each micro-batch's mean token loss;
each micro-batch's backward is scaled by 1/num_micro_batches, and gradients are averaged
over data-parallel ranks, so every layout computes the gradient of the same global mean.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratron.distributed import comm

from paratron.optim.build import clip_grad_norm
from paratron.parallel.data import DataParallel


class Precision:
    """Autocast for bf16/fp16 compute over fp32 weights; dynamic loss scaling for fp16.

    `group` is the group gradient norms are summed over (model-parallel ranks, or all ranks
    when gradients are sharded over data-parallel ranks): an overflow in any rank's part of
    the gradients must skip the step (and back the scale off) on all of them."""

    def __init__(self, precision: str, device: torch.device, group: Any = None) -> None:
        self.device, self.group = device, group
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            # GradScaler checks only this rank's gradients; agree on the verdict across the group.
            for found_inf in self.scaler._found_inf_per_device(optimizer).values():
                comm.all_reduce(found_inf, self.group, op=dist.ReduceOp.MAX)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the update; False when fp16 gradients overflowed and the step was skipped."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss of this rank's micro-batches (detached; not yet averaged over ranks). Under
    pipeline parallelism only the last stage knows it; the other stages hold zero."""
    grad_norm: torch.Tensor
    skipped: bool


def train_step(model: DataParallel, optimizer: torch.optim.Optimizer,
               batches: list[tuple[torch.Tensor, torch.Tensor]], precision: Precision,
               clip_grad: float) -> StepResult:
    model.zero_grad_buffer()
    if model.pipeline is not None:
        loss = model.pipeline.train_step(batches, precision.backward, precision.autocast)
    else:
        total = torch.zeros((), device=batches[0][0].device)
        for i, (inputs, labels) in enumerate(batches):
            model.require_grad_sync(i == len(batches) - 1)
            with precision.autocast():
                logits = model(inputs)
            micro_loss = model.loss_function(logits, labels)
            precision.backward(micro_loss / len(batches))
            total += micro_loss.detach()
        loss = total / len(batches)
    model.finish_grad_sync()
    if hasattr(optimizer, "prepare_grads"):  # the distributed optimizer takes its shard of the result
        optimizer.prepare_grads()
    precision.unscale(optimizer)
    # whole gradients on the model, or this rank's shards on the distributed optimizer
    holder = optimizer if hasattr(optimizer, "gradients_for_norm") else model
    grads, weights, group = holder.gradients_for_norm()
    grad_norm = clip_grad_norm(grads, clip_grad, group, weights)
    stepped = precision.step(optimizer)
    return StepResult(loss, grad_norm, skipped=not stepped)


@torch.no_grad()
def evaluate_batches(model: DataParallel, batches: list[tuple[torch.Tensor, torch.Tensor]],
                     precision: Precision) -> torch.Tensor:
    """Mean loss over the given micro-batches (this rank's share of the evaluation; zero on
    pipeline stages other than the last)."""
    was_training = model.training
    model.eval()
    if model.pipeline is not None:
        mean = model.pipeline.evaluate(batches, precision.autocast)
    else:
        total = torch.zeros((), device=batches[0][0].device)
        for inputs, labels in batches:
            with precision.autocast():
                total += model.loss_function(model(inputs), labels)
        mean = total / len(batches)
    model.train(was_training)
    return mean
