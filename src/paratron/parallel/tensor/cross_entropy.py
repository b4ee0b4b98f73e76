"""Cross-entropy over vocabulary-parallel logits, without ever gathering them.

Each rank holds logits for its slice of the vocabulary. Three all-reduces of one number per
token give the global max (for stability), the target's logit (held by one rank) and the sum
of exponentials; the loss is log(sum exp) - target logit. The gradient, softmax - one-hot,
needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        max_logit = logits.max(dim=-1).values
        comm.all_reduce(max_logit, group, op=dist.ReduceOp.MAX)
        shifted = logits - max_logit.unsqueeze(-1)

        local_target = target - vocab_start
        mine = (local_target >= 0) & (local_target < logits.size(-1))
        local_target = local_target.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        comm.all_reduce(target_logit, group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, mine)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: RankGroup
) -> torch.Tensor:
    """Per-token loss [..] from logits [.., vocab slice] whose first column is vocabulary id `vocab_start`."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)
