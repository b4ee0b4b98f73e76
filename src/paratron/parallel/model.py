"""This rank's part of the model, as `parallelize` returns it, and how one step runs on it.

A `ParallelModel` holds the plain model part (`module`: the single-device `GPT` with what this
rank does not hold removed and its layers swapped for their parallel twins) together with
what running it takes: the loss function (vocabulary-parallel under tensor parallelism), the
gradients and their data-parallel synchronisation, the pipeline runtime when the model is cut
into stages, the flat parameter buffer of the distributed optimizer, and the random streams
of tensor-parallel regions. Its one training entry point, `forward_backward`, hides whether a
pipeline runs the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratron.distributed.rng import RNGStates
from paratron.distributed.topology import Axis, RankGroup, Topology
from paratron.parallel.data.ddp import DataParallelGradients
from paratron.parallel.data.param_gather import FlatParameters
from paratron.parallel.pipeline.runtime import PipelineRuntime

Batch = tuple[torch.Tensor, torch.Tensor]
LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ParallelModel(nn.Module):
    """This rank's model part and the machinery of its training step (see the module docstring).

    Per step: `zero_grad()`, then `forward_backward(micro_batches, backward)`, after which every
    gradient is complete and averaged over data-parallel ranks; the optimizer takes it from
    there (`optim.protocol.TrainingOptimizer`)."""

    def __init__(
        self,
        module: nn.Module,
        topology: Topology,
        loss_function: LossFunction,
        gradients: DataParallelGradients,
        pipeline: PipelineRuntime | None = None,
        flat_parameters: FlatParameters | None = None,
        rng: RNGStates | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.topology = topology
        self.loss_function = loss_function
        self.gradients = gradients
        self.pipeline = pipeline
        self.flat_parameters = flat_parameters
        self.rng_states = rng  # named generators of tensor-parallel regions (checkpointed)

    @property
    def trained_parameters(self) -> list[nn.Parameter]:
        return self.gradients.params

    @property
    def zero_stage(self) -> int:
        return self.gradients.settings.zero_stage

    @property
    def norm_group(self) -> RankGroup:
        """The ranks whose gradient pieces together make up the whole model's gradient once: the
        model-parallel group (tensor x pipeline), or every rank when ZeRO shards the gradients
        or parameters over data parallelism."""
        sharded = self.zero_stage > 0 and self.topology.size(Axis.DP) > 1
        return self.topology.group(Axis.WORLD if sharded else Axis.MODEL)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; they stay views of their buffers whatever `set_to_none` says."""
        self.gradients.zero()

    def forward_backward(
        self, batches: list[Batch], backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    ) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, each micro-batch's loss divided by
        their number, then the gradients' synchronisation. `backward(loss)` starts a backward pass
        (the loss scaler's multiplies first). Returns the mean loss; under pipeline parallelism only
        the last stage knows it, the other stages return zero."""
        if self.pipeline is not None:
            loss = self.pipeline.forward_backward(batches, backward)
        else:
            total = torch.zeros((), device=batches[0][0].device)
            for i, (inputs, labels) in enumerate(batches):
                self.gradients.require_sync(i == len(batches) - 1)
                micro_loss = self.loss_function(self.module(inputs), labels)
                backward(micro_loss / len(batches))
                total += micro_loss.detach()
            loss = total / len(batches)
        self.gradients.finish()
        return loss

    def finish_grad_sync(self) -> None:
        """Complete the gradients of backward passes run by hand (as `forward_backward` does)."""
        self.gradients.finish()

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> torch.Tensor:
        """Mean loss over the micro-batches, forward only (zero on pipeline stages but the last)."""
        was_training = self.training
        self.eval()
        if self.pipeline is not None:
            mean = self.pipeline.evaluate(batches)
        else:
            total = torch.zeros((), device=batches[0][0].device)
            for inputs, labels in batches:
                total += self.loss_function(self.module(inputs), labels)
            mean = total / len(batches)
        self.train(was_training)
        return mean

    def wait_param_gather(self) -> None:
        """Wait for the distributed optimizer's parameter gathers still in flight (before the
        weights are read outside a forward: saving, the end of training)."""
        if self.flat_parameters is not None:
            self.flat_parameters.wait()
