"""The output layer and the cross-entropy in one pass over chunks of tokens: the logits are never whole.

The unfused loss holds fp32 logits [tokens, vocab] and their gradient, the largest tensors of a step at a large
vocabulary (8,192 tokens x 128,256 words: 4.2 GB each). Here the tokens go through in chunks whose fp32 logits
stay under `CHUNK_LOGIT_ELEMENTS`: forward computes a chunk's logits, its log-sum-exp and target logit, and at
once the gradient of the chunk's losses with respect to the hidden states and the output weight (softmax minus
one-hot, times W or times h). Backward only scales what forward kept by the incoming gradient. Per-token losses
come back as `token_losses` gives them, so the loss weighting around them is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from paratron.model.batch import IGNORE_INDEX

CHUNK_LOGIT_ELEMENTS = 1 << 24
"""fp32 logits of one chunk at most (64 MiB, with as much again for their gradient): small against the whole
logits at a large vocabulary, large enough that each chunk's matmuls stay efficient."""


def chunk_tokens(vocab_size: int, limit: int = CHUNK_LOGIT_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's fp32 logits hold at most `limit` elements (at least one token)."""
    return max(1, limit // vocab_size)


@dataclass(frozen=True)
class VocabSlice:
    """The output weight holds vocabulary ids `start`.. of a vocabulary split over ranks (its rows from `valid` on
    are padding); `all_reduce(tensor, "max" | "sum")` combines, in place, one number per token over those ranks."""

    start: int
    valid: int
    all_reduce: Callable[[torch.Tensor, str], None]


def chunked_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    token_weights: torch.Tensor | None = None,
    with_grad: bool = True,
    weight_grad: bool = True,
    part: VocabSlice | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token losses [N] of `hidden` [N, H] through `weight` [V, H] against `labels` [N], and (with `with_grad`)
    the gradients of their sum weighted by `token_weights` [N] (all ones when None) w.r.t. hidden (fp32) and, with
    `weight_grad`, weight (fp32; None otherwise). Ignored labels give zero loss and no gradient. With `part` the
    weight is a vocabulary slice: the losses are the whole vocabulary's, the hidden gradient is this slice's part
    (summed over the ranks by the caller), the weight gradient this slice's."""
    n = hidden.size(0)
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if with_grad else None
    keep_weight_grad = with_grad and weight_grad
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if keep_weight_grad else None
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        scale = None
        if with_grad:
            trained = (labels[rows] != IGNORE_INDEX).float()
            scale = trained if token_weights is None else token_weights[rows].float() * trained
        # (one chunk at a time: its buffers are freed when the call returns, before the next chunk's exist)
        _one_chunk(hidden[rows], weight, labels[rows], part, losses[rows], scale, grad_hidden, grad_weight, rows)
    return losses, grad_hidden, grad_weight


def _one_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    part: VocabSlice | None,
    losses: torch.Tensor,
    scale: torch.Tensor | None,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    rows: slice,
) -> None:
    """One chunk of `chunked_loss_and_grads`: its losses into `losses`, and with `scale` (each token's weight) its
    gradients into `grad_hidden[rows]` and added to `grad_weight` (when not None)."""
    logits = (h @ weight.t()).float()
    trained = target != IGNORE_INDEX
    local = target - (part.start if part is not None else 0)
    mine = trained & (local >= 0) & (local < (part.valid if part is not None else logits.size(-1)))
    safe_target = local.masked_fill(~mine, 0)
    target_logit = logits.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    if part is not None:
        logits[:, part.valid :] = float("-inf")  # (padding rows: never predicted)
        part.all_reduce(target_logit, "sum")
    top = logits.amax(dim=-1, keepdim=True)
    if part is not None:
        part.all_reduce(top, "max")
    exp = logits.sub_(top).exp_()  # (in the logits' storage: one chunk-sized buffer all the way)
    sum_exp = exp.sum(dim=-1, keepdim=True)
    if part is not None:
        part.all_reduce(sum_exp, "sum")
    losses.copy_((sum_exp.log().add_(top).squeeze(-1) - target_logit) * trained)
    if scale is None:
        return
    grad_logits = exp.div_(sum_exp)  # (the softmax)
    grad_logits.scatter_add_(-1, safe_target.unsqueeze(-1), -mine.unsqueeze(-1).float())
    grad_logits.mul_(scale.unsqueeze(-1))
    grad_logits = grad_logits.to(weight.dtype)
    grad_hidden[rows] = grad_logits @ weight
    if grad_weight is None:
        return
    if grad_logits.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.t(), h)
    else:
        grad_weight.add_(grad_logits.t() @ h)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, with_grad, part):
        weight_grad = weight.requires_grad
        losses, grad_hidden, grad_weight = chunked_loss_and_grads(
            hidden, weight, labels, chunk, None, with_grad, weight_grad, part
        )
        ctx.chunk, ctx.weight_grad, ctx.part = chunk, weight_grad, part
        if with_grad:
            ctx.save_for_backward(grad_hidden, grad_weight, hidden, weight, labels)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        grad_hidden, grad_weight, hidden, weight, labels = ctx.saved_tensors
        trained = grad_losses[labels != IGNORE_INDEX]
        if trained.numel() == 0:
            factor = torch.zeros((), dtype=torch.float32, device=grad_hidden.device)
        elif bool((trained == trained[0]).all()):  # (a summed or averaged loss: one factor for every token)
            factor = trained[0].float()
        else:  # (tokens weighted apart: the sum over tokens in dW needs each weight, so the chunks run again)
            factor = None
            _, grad_hidden, grad_weight = chunked_loss_and_grads(
                hidden, weight, labels, ctx.chunk, grad_losses, True, ctx.weight_grad, ctx.part
            )
        if factor is not None:  # (in place: what forward kept is needed no more, and a copy is as large again)
            grad_hidden = grad_hidden.mul_(factor)
            grad_weight = grad_weight.mul_(factor) if grad_weight is not None else None
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None


def fused_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int | None = None,
    part: VocabSlice | None = None,
) -> torch.Tensor:
    """The losses `token_losses(hidden @ weight.T, labels)` gives ([B, T] from hidden states [B, T, H] and the
    output weight [V, H]), without the whole logits; `chunk` tokens at a time (default: `chunk_tokens(V)`).
    Gradients are computed in forward only when autograd will want them. With `part` (a vocabulary-parallel output
    layer) see `chunked_loss_and_grads`."""
    chunk = chunk if chunk is not None else chunk_tokens(weight.size(0))
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    flat = _FusedLinearCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk, with_grad, part)
    return flat.view(labels.shape)
