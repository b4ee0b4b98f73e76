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

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paratron.debugging.layer_stats import LayerStats
from paratron.distributed import comm
from paratron.distributed.init import release_unused_memory
from paratron.model.batch import Batch
from paratron.optim.build import clip_grad_norm
from paratron.optim.mixed_precision import Precision
from paratron.optim.protocol import GradsForNorm, TrainingOptimizer
from paratron.parallel.data_parallel.fully_sharded import local_tensor
from paratron.parallel.model import ParallelModel
from paratron.training.expert_load import ExpertStats, take_expert_stats, update_expert_biases
from paratron.training.profiling import StepTimers


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
    num_zeros_in_grad: torch.Tensor | None = None
    """Zero entries of the whole model's gradients (with --log-num-zeros-in-grad; None otherwise)."""
    images: int = 0
    """Images (tiles) in this rank's micro-batches (a vision-language model's; for its FLOPs)."""
    withheld: bool = False
    """`StepOptions.withhold` kept the step from being applied (a loss spike under --on-spike skip or rollback)."""


@dataclass
class StepOptions:
    """How a step runs beyond its arithmetic: checks, counts, timers and memory release."""

    check_nonfinite: bool = True
    """Withhold a step whose gradient norm is not finite (--check-for-nan-in-loss-and-grad)."""
    count_zeros: bool = False
    """Count the zero entries of the gradients (--log-num-zeros-in-grad)."""
    timers: StepTimers | None = None
    empty_unused_memory_level: int = 0
    device: torch.device | None = None
    after_grads: Callable[[TrainingOptimizer], None] | None = None
    """Called with the optimizer once it holds the step's reduced gradients, before unscaling and clipping
    (--debug-capture reads them there)."""
    layer_stats: LayerStats | None = None
    """This step's per-layer statistics (--log-layer-stats, on the steps it records): it watches the forwards and is
    given the gradients before clipping and the weights after the update."""
    withhold: Callable[[torch.Tensor], bool] | None = None
    """Asked with the step's loss before the optimizer steps (--loss-spike-zscore; every rank asks): True keeps the
    step from being applied."""


def train_step(
    model: ParallelModel,
    optimizer: TrainingOptimizer,
    batches: list[Batch],
    precision: Precision,
    clip_grad: float,
    per_token_loss: bool = False,
    options: StepOptions | None = None,
) -> StepResult:
    options = options or StepOptions()
    timers = options.timers or StepTimers(0, torch.device("cpu"))
    weights, trained = model.loss_weights(batches, per_token_loss)
    model.set_aux_loss_scale(precision.loss_scale / len(batches))  # MoE: the mean over micro-batches
    model.zero_grad()
    stats = options.layer_stats
    with timers.time("forward-backward"), stats.watch() if stats is not None else contextlib.nullcontext():
        # (the gradients come back complete and averaged)
        loss = model.forward_backward(batches, weights=weights, backward=precision.backward)
    withheld = options.withhold is not None and options.withhold(loss)
    if options.empty_unused_memory_level >= 1 and options.device is not None:
        release_unused_memory(options.device)
    experts = take_expert_stats(model)
    with timers.time("optimizer"):
        with timers.time("all-grads-sync"):
            optimizer.prepare_grads()
        if options.after_grads is not None:
            options.after_grads(optimizer)
        grads = optimizer.grads_for_norm()
        with timers.time("optimizer-unscale-and-check-inf"):
            overflow = precision.unscale(grads.tensors, grads.group)
        grad_norm, nonfinite, zeros = None, False, None
        if not overflow:
            grad_norm, nonfinite, zeros = _clip_and_apply(
                model, optimizer, grads, clip_grad, options, timers, experts, withheld
            )
        precision.update(overflow)
    if options.empty_unused_memory_level >= 2 and options.device is not None:
        release_unused_memory(options.device)
    images = sum(batch.images.size(0) for batch in batches if batch.images is not None)
    return StepResult(
        loss,
        grad_norm,
        overflow,
        trained,
        experts,
        nonfinite,
        num_zeros_in_grad=zeros,
        images=images,
        withheld=withheld,
    )


def _clip_and_apply(
    model: ParallelModel,
    optimizer: TrainingOptimizer,
    grads: GradsForNorm,
    clip_grad: float,
    options: StepOptions,
    timers: StepTimers,
    experts: ExpertStats | None,
    withheld: bool,
) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """Clip the unscaled gradients of a step that did not overflow and apply them unless their norm is not finite
    or the step is withheld; returns the norm before clipping, whether it was not finite, and the zero count."""
    stats = options.layer_stats
    if stats is not None:
        stats.take_grads(grads)
    with timers.time("optimizer-clip-main-grad"):
        grad_norm = clip_grad_norm(grads.tensors, clip_grad, grads.group, grads.weights)
    # without the check (--no-check-for-nan-in-loss-and-grad) a non-finite step is applied, as in Megatron-LM
    nonfinite = options.check_nonfinite and not bool(torch.isfinite(grad_norm))
    zeros = None
    if options.count_zeros:
        with timers.time("optimizer-count-zeros"):
            zeros = count_zeros(grads)
    if not (nonfinite or withheld):
        with timers.time("optimizer-inner-step"):
            optimizer.step()
        if stats is not None:
            stats.take_update()
        with timers.time("optimizer-copy-main-to-model-params"):
            optimizer.after_step()
        update_expert_biases(model, experts)
    return grad_norm, nonfinite, zeros


def count_zeros(grads: GradsForNorm) -> torch.Tensor:
    """Zero entries of the whole model's gradients (--log-num-zeros-in-grad): each tensor's count
    weighted as in the gradient norm, so that a gradient several ranks hold counts once, summed
    over the norm's group."""
    if grads.tensors:
        counts = torch.stack([(g.numel() - torch.count_nonzero(g)).to(torch.float64) for g in grads.tensors])
        weights = grads.weights.to(torch.float64) if grads.weights is not None else torch.ones_like(counts)
        total = (weights.to(counts.device) * counts).sum()
    else:
        device = grads.weights.device if grads.weights is not None else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
    if grads.weights is not None:  # (no weights: this rank holds the whole gradient)
        comm.all_reduce(total, grads.group)
    return total.round()


def params_norm(optimizer: TrainingOptimizer) -> torch.Tensor:
    """L2 norm of all trained parameters of the whole model (--log-params-norm; Megatron-LM's
    calc_params_l2_norm): the fp32 master weights the optimizer steps (the weights themselves in
    fp32 runs), each tensor weighted as in the gradient norm so that one held by several ranks
    counts once, summed over the norm's group."""
    grads = optimizer.grads_for_norm()  # (for its weights and group: one per master, in order)
    masters = [local_tensor(piece.master.detach()) for piece in optimizer.pieces()]
    if grads.weights is None:
        return torch.nn.utils.get_total_norm(masters, norm_type=2.0, foreach=True) if masters else torch.zeros(())
    squared = torch.zeros((), device=grads.weights.device)
    if masters:
        norms = torch.stack(torch._foreach_norm([m.float() for m in masters]))
        squared = (grads.weights * norms.to(grads.weights.device).pow(2)).sum()
    comm.all_reduce(squared, grads.group)
    return squared.sqrt()
