"""The fused output layer + cross-entropy (`model.fused_loss`) over a vocabulary-parallel output layer.

Each rank runs the chunks through its rows of the output weight; per chunk, three all-reduces of one number per
token (the target's logit, the max, the sum of exponentials) give every rank the whole vocabulary's loss, as in
`cross_entropy.py`. The hidden states reach the loss as they reach the output layer: copied into the tensor-parallel
region (their gradient all-reduced) or, under sequence parallelism, gathered from the sequence shards (their
gradient reduce-scattered), so each rank's partial gradient of the hidden states is completed as before.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.model.fused_loss import VocabSlice, fused_token_losses
from paratron.parallel.sharding import shard_of
from paratron.parallel.tensor.layers import VocabParallelOutput, enter_column_region

_OPS = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


def _all_reduce(tensor: torch.Tensor, op: str, group: RankGroup) -> None:
    comm.all_reduce(tensor, group, op=_OPS[op])


def vocab_parallel_fused_token_losses(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    output: VocabParallelOutput,
    vocab_start: int,
    chunk: int | None = None,
) -> torch.Tensor:
    """Per-token losses [B, T] of the final norm's output `hidden` ([B, T, H], or this rank's sequence shard
    under sequence parallelism) through the vocabulary-parallel `output` layer, whose rows begin at vocabulary id
    `vocab_start` (`output_vocab_start`), without its logits; `chunk` tokens at a time (default: as
    `fused_token_losses` chooses for this rank's slice)."""
    whole = enter_column_region(hidden, output.tp)
    part = VocabSlice(vocab_start, output.valid_rows, partial(_all_reduce, group=output.tp.group))
    return fused_token_losses(whole, output.weight, labels, chunk, part)


def output_vocab_start(output: VocabParallelOutput) -> int:
    """The first vocabulary id of this rank's output rows, read from the weight's record when the layer is built:
    under ZeRO-3 the weight the loss reads is the one FSDP2 gathers for compute, which carries no record."""
    shard = shard_of(output.weight)
    return shard.start if shard is not None else 0
