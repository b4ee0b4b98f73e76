"""This rank's part of the model, as `parallelize` returns it, and how one step runs on it.

A `ParallelModel` holds the plain model part (`module`: the single-device `GPT` with what this
rank does not hold removed and its layers swapped for their parallel twins) together with
what running it takes: the per-token loss (vocabulary-parallel under tensor parallelism), the
gradients and their data-parallel synchronisation, the pipeline runtime when the model is cut
into stages, the flat parameter buffer of the distributed optimizer, and the random streams
of tensor-parallel regions. Its one training entry point, `forward_backward`, hides whether a
pipeline runs the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
from torch import nn

from paratron.distributed import comm
from paratron.distributed.rng import RNGStates
from paratron.distributed.topology import Axis, RankGroup, Topology
from paratron.model.batch import Batch
from paratron.model.loss import mean_loss
from paratron.model.moe import MoELayer
from paratron.parallel.context.split import split_batch
from paratron.parallel.data_parallel.ddp import DataParallelGradients
from paratron.parallel.data_parallel.fully_sharded import gather_for_use
from paratron.parallel.data_parallel.param_gather import FlatParameters
from paratron.parallel.pipeline.runtime import PipelineRuntime
from paratron.parallel.sharding import grad_norm_weight, is_expert

TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits, labels) -> the loss of every position [B, T], zero where the label is not trained."""

FusedLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(the final norm's output, labels) -> the loss of every position [B, T], the output layer applied inside the loss
chunk by chunk (--cross-entropy-loss-fusion)."""


class ParallelModel(nn.Module):
    """This rank's model part and the machinery of its training step (see the module docstring).

    Per step: `zero_grad()`, then `forward_backward(micro_batches, weights=..., backward=...)`, after which
    every gradient is complete and averaged over data-parallel ranks; the optimizer takes it from
    there (`optim.protocol.TrainingOptimizer`)."""

    def __init__(
        self,
        module: nn.Module,
        topology: Topology,
        token_loss: TokenLoss,
        gradients: DataParallelGradients,
        pipeline: PipelineRuntime | None = None,
        flat_parameters: list[FlatParameters] | None = None,
        rng: RNGStates | None = None,
        fused_loss: FusedLoss | None = None,
        before_gathers: Callable[[nn.Module], None] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.topology = topology
        self.token_loss = token_loss
        self.gradients = gradients
        self.pipeline = pipeline
        self.flat_parameters = flat_parameters or []  # (the distributed optimizer's: dense, then experts)
        self.rng_states = rng  # named generators of tensor-parallel regions (checkpointed)
        self.fused_loss = fused_loss  # set: the output layer runs inside the loss, in chunks (`model.fused_loss`)
        if pipeline is not None:
            pipeline.runner.fused_loss = fused_loss  # (the last stage's runner applies it inside its forward)
        self.before_gathers = before_gathers  # run on the module before a step's or an evaluation's forwards

    @property
    def trained_parameters(self) -> list[nn.Parameter]:
        return self.gradients.params

    @property
    def zero_stage(self) -> int:
        return self.gradients.settings.zero_stage

    @property
    def _data_sharded(self) -> bool:
        """Whether ZeRO shards the dense gradients (or parameters) over the data-parallel ranks."""
        return self.zero_stage > 0 and self.gradients.group.size > 1

    @property
    def _experts_sharded(self) -> bool:
        """Whether ZeRO shards the experts' gradients over their expert-data-parallel ranks."""
        return self.zero_stage > 0 and self.topology.size(Axis.EXPERT_DP) > 1

    @cached_property
    def _has_experts(self) -> bool:
        return any(is_expert(p) for p in self.trained_parameters)

    @property
    def norm_group(self) -> RankGroup:
        """The ranks whose gradient pieces together make up the whole model's gradient: the
        model-parallel group (tensor x pipeline), or every rank when ZeRO shards the gradients
        or parameters over data parallelism, or the model has experts (laid out on a grid of
        their own)."""
        whole = self._data_sharded or self._has_experts
        return self.topology.group(Axis.WORLD if whole else Axis.MODEL)

    def norm_weight(self, param: torch.Tensor) -> float:
        """`param`'s weight in the global gradient norm summed over `norm_group`: each tensor counts
        once (see `sharding.grad_norm_weight`). Summed over every rank, a dense gradient that ZeRO
        does not shard is held by each data- (and context-) parallel rank, and an expert's by each
        expert-data-parallel one."""
        replicas = (1, 1)
        if self._data_sharded or self._has_experts:  # (summed over every rank)
            replicas = (
                1 if self._data_sharded else self.topology.size(Axis.DP_CP),
                1 if self._experts_sharded else self.topology.size(Axis.EXPERT_DP),
            )
        return grad_norm_weight(param, self.topology.size(Axis.TP), replicas)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @cached_property
    def moe_layers(self) -> dict[int, MoELayer]:
        """This rank's mixture-of-experts layers by their ordinal among the model's MoE layers."""
        pattern = self.module.config.moe_layer_pattern
        layers = {}
        for name, module in self.module.named_modules():
            if isinstance(module, MoELayer):
                index = int(name.split("layers.", 1)[1].split(".", 1)[0])
                layers[sum(pattern[:index])] = module
        return layers

    def set_aux_loss_scale(self, scale: float) -> None:
        """The factor of the MoE load-balancing losses' gradients in the coming backward passes
        (the loss scale over the number of micro-batches: their mean, scaled as the main loss is)."""
        for layer in self.moe_layers.values():
            layer.aux_loss_scale = scale

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss over the trained labels of these logits."""
        return mean_loss(self.token_loss(logits, labels), labels)

    def _run(self, batch: Batch) -> torch.Tensor:
        """Summed token loss of one micro-batch through the whole (unpipelined) model; with loss fusion the model
        stops before its output layer and the fused loss applies it chunk by chunk."""
        out = self.module(
            batch.input_ids,
            position_ids=batch.position_ids,
            segment_ids=batch.segment_ids,
            token_index=batch.token_index,
            images=batch.images,
            before_output=self.fused_loss is not None,
        )
        if self.fused_loss is not None:
            gather_for_use(self.module)  # (ZeRO-3: the output weight is the root unit's, read after its forward)
            return self.fused_loss(out, batch.labels).sum()
        return self.token_loss(out, batch.labels).sum()

    def _context_parts(self, batches: list[Batch]) -> list[Batch]:
        """This rank's share of each row under context parallelism (the batches themselves otherwise)."""
        cp = self.topology.group(Axis.CP)
        return batches if cp.size == 1 else [split_batch(batch, cp.size, cp.rank) for batch in batches]

    def _whole(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss summed over the context-parallel ranks' shares of the rows."""
        cp = self.topology.group(Axis.CP)
        if cp.size > 1:
            loss = loss.clone()
            comm.all_reduce(loss, cp)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; they stay views of their buffers whatever `set_to_none` says."""
        self.gradients.zero()

    def loss_weights(self, batches: list[Batch], per_token: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The weight of each micro-batch's summed token loss, and this rank's trained-token count.

        Per token, the weight is data-parallel size / the global batch's trained tokens (their
        count summed over the data-parallel ranks by one scalar all-reduce; data parallelism
        averages gradients, hence the factor); otherwise 1 / (the micro-batch's trained tokens x
        the number of micro-batches), the mean over micro-batches of their mean token loss."""
        counts = torch.stack([batch.trained_tokens() for batch in batches])
        local = counts.sum()
        if per_token:
            total = local.to(torch.float32)  # (a new tensor: reduced in place)
            dp = self.topology.group(Axis.DP)
            comm.all_reduce(total, dp)
            return [dp.size / total.clamp(min=1)] * len(batches), local
        return [1.0 / (count.clamp(min=1).to(torch.float32) * len(batches)) for count in counts], local

    def forward_backward(
        self,
        batches: list[Batch],
        *,
        weights: list[torch.Tensor] | None = None,
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    ) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, micro-batch m's loss being the sum
        of its token losses times `weights[m]` (default: `loss_weights(batches, per_token=False)`),
        then the gradients' synchronisation. `backward(loss)` starts a backward pass (the loss
        scaler's multiplies first). Returns the sum of the weighted losses; under pipeline
        parallelism only the last stage knows it, the other stages return zero.

        Under context parallelism every rank of the group gets the whole micro-batches (the weights
        count their whole rows) and runs its share of each row; the returned loss is the whole's."""
        if weights is None:
            weights, _ = self.loss_weights(batches, per_token=False)
        batches = self._context_parts(batches)
        if self.before_gathers is not None:
            self.before_gathers(self.module)
        if self.pipeline is not None:
            loss = self.pipeline.forward_backward(batches, weights=weights, backward=backward)
        else:
            loss = torch.zeros((), device=batches[0].device)
            for i, (batch, weight) in enumerate(zip(batches, weights)):
                self.gradients.require_sync(i == len(batches) - 1)
                micro_loss = self._run(batch) * weight
                backward(micro_loss)
                loss += micro_loss.detach()
        self.gradients.finish()
        return self._whole(loss)

    def finish_grad_sync(self) -> None:
        """Complete the gradients of backward passes run by hand (as `forward_backward` does)."""
        self.gradients.finish()

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> torch.Tensor:
        """Summed token loss over the micro-batches, forward only (zero on pipeline stages but the
        last); divide by their trained tokens for the mean."""
        was_training = self.training
        self.eval()
        batches = self._context_parts(batches)
        if self.before_gathers is not None:
            self.before_gathers(self.module)
        if self.pipeline is not None:
            total = self.pipeline.evaluate(batches)
        else:
            total = torch.zeros((), device=batches[0].device)
            for batch in batches:
                total += self._run(batch)
        self.train(was_training)
        return self._whole(total)

    def wait_param_gather(self) -> None:
        """Wait for the distributed optimizer's parameter gathers still in flight (before the
        weights are read outside a forward: saving, the end of training)."""
        for flat in self.flat_parameters:
            flat.wait()
