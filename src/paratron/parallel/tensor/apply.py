"""Turn the plain GPT into this rank's tensor-parallel part (Megatron-LM's layout).

    attention   q/k/v projections column-parallel by heads, as one matrix (key/value heads
                split, or replicated when TP exceeds their number), output projection row-parallel;
                the attention core runs on this rank's heads under the tensor-parallel RNG; the
                query/key norms (--qk-layernorm) are whole, their gradients summed over TP
    MLP         up (and gate) projections column-parallel, as one matrix; down projection row-parallel
                (mixture-of-experts layers are left to `parallel.expert.apply`)
    embedding   vocabulary-parallel, padded to a multiple of TP x --make-vocab-size-divisible-by;
                the output layer is vocabulary-parallel too (tied weights stay tied). On a single
                rank only these two are swapped (`apply_vocab_parallel`), when padding adds rows
    sequence parallel (optional): between the row- and column-parallel layers the activations
                are split along the sequence; norms and dropout run on those shards, norm
                gradients are summed over the TP group
    LoRA        an adapted layer's twin carries its adapter, split with it (see layers.py):
                column-parallel  A whole (gradient summed over TP), B by rows like W (a
                                 replicated k/v head's B summed over its replicas, like W)
                row-parallel     A by columns like W, B whole (gradient summed over TP)
                frozen weights stay frozen
    vision      the encoder's layers as the language model's (its heads split, never its sequence);
                patches, positions, norms and the projector whole. Under sequence parallelism the
                token embedding is reduced whole, the images' features put in, then the rows are
                cut by sequence (a hook on the vision model)

Works on a model on the meta device, before its weights exist.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from torch import nn

from paratron.distributed import comm
from paratron.distributed.rng import TENSOR_PARALLEL, Forked, RNGStates
from paratron.distributed.topology import RankGroup
from paratron.model.gpt import GPT
from paratron.model.layer_kind import Column, ColumnInput, LayerKind, PartialGradient, Row
from paratron.model.transformer import Residual
from paratron.parallel.sharding import set_partial_grad
from paratron.parallel.tensor.layers import (
    ColumnParallelLinear,
    ColumnParallelProjections,
    ColumnRegionEntry,
    RowParallelLinear,
    SequenceShardedEmbedding,
    TPContext,
    VocabParallelEmbedding,
    VocabParallelOutput,
)


def _replicated_rows(linear: ColumnParallelLinear) -> list[nn.Parameter]:
    """The parameters holding a column-parallel layer's rows (not a LoRA A, which is whole and
    summed over the whole tensor-parallel group)."""
    return [p for p in (linear.weight, linear.bias, linear.lora_b) if p is not None]


def apply_tensor_parallel(
    model: GPT, tp: TPContext, rng: RNGStates | None, divisible_by: int, kv_replica_group: RankGroup | None = None
) -> GPT:
    """Replace `model`'s layers in place by their tensor-parallel twins; returns the model."""
    for block in model.layers:
        _split_block(block, tp, rng, kv_replica_group)
    if model.vision is not None:  # (the encoder's layers split as the language model's, never by sequence)
        whole = dataclasses.replace(tp, sequence_parallel=False)
        for block in model.vision.encoder.layers:
            _split_block(block, whole, rng, None)
        if tp.sequence_parallel:  # the features join the whole rows, which are then cut by sequence
            model.vision.register_forward_hook(partial(_to_sequence_shard, group=tp.group))

    apply_vocab_parallel(model, tp, divisible_by)
    if tp.sequence_parallel:
        if model.position_embedding is not None:
            model.position_embedding = SequenceShardedEmbedding(model.position_embedding, tp)
        for param in model.final_norm.parameters():
            set_partial_grad(param, tp.group)
        model.embedding_dropout = _forked(model.embedding_dropout, rng)
    return model


def apply_vocab_parallel(model: GPT, tp: TPContext, divisible_by: int) -> GPT:
    """Replace `model`'s embedding and output layer by their vocabulary-parallel twins, padded to a multiple of
    TP x `divisible_by` (tied weights stay tied), in place; returns the model. Also on a single rank, where it is
    the only swap: the output matmul then runs over the padded vocabulary, the rest of the model stays as it is."""
    embedding_tp = dataclasses.replace(tp, sequence_parallel=False) if model.vision is not None else tp
    model.embedding = VocabParallelEmbedding(model.embedding, embedding_tp, divisible_by)
    model.output = VocabParallelOutput(model.output, tp, divisible_by)
    model.tie_weights()
    return model


def _split_block(block: Residual, tp: TPContext, rng: RNGStates | None, kv_replica_group: RankGroup | None) -> None:
    """One layer's kinds swapped for their tensor-parallel twins as each kind's plan declares, in place; under
    sequence parallelism the norms in front of them run on sequence shards, their gradients summed over TP."""
    for kind in block.kinds().values():
        split_by_plan(kind, tp, rng, kv_replica_group)
    if tp.sequence_parallel:
        for norm in block.norms():
            for param in norm.parameters():
                set_partial_grad(param, tp.group)


def split_by_plan(kind: LayerKind, tp: TPContext, rng: RNGStates | None, kv_replica_group: RankGroup | None) -> None:
    """`kind`'s children split as its `tensor_parallel_plan()` says (`model.layer_kind`), in place."""
    for name, split in kind.tensor_parallel_plan().items():
        child = getattr(kind, name)
        if isinstance(split, Column) and not isinstance(child, nn.ModuleDict):
            setattr(kind, name, ColumnParallelLinear.split(child, tp, 1, None))
        elif isinstance(split, Column):
            twin = ColumnParallelProjections(child, tp, dict(split.heads))
            setattr(kind, name, twin)
            for projection, (_, heads) in split.heads.items():
                if heads < tp.size:  # a replicated key/value head: its gradient is split over the replicas
                    for param in _replicated_rows(twin[projection]):
                        set_partial_grad(param, kv_replica_group)
        elif isinstance(split, Row):
            setattr(kind, name, RowParallelLinear(child, tp))
        elif isinstance(split, PartialGradient):
            if not split.sequence_parallel_only or tp.sequence_parallel:
                for param in child.parameters():
                    set_partial_grad(param, tp.group)
        elif isinstance(split, ColumnInput):
            setattr(kind, name, ColumnRegionEntry(tp))
        elif not split.sequence_parallel_only or tp.sequence_parallel:  # (Random)
            setattr(kind, name, _forked(child, rng))


def _forked(module: nn.Module, rng: RNGStates | None) -> nn.Module:
    """`module` run under the tensor-parallel random stream (dropout that differs across TP ranks)."""
    return Forked(module, rng, TENSOR_PARALLEL) if rng is not None else module


def _to_sequence_shard(module: nn.Module, inputs: tuple, output: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """A forward hook: the merged embeddings [B, T, width] cut to this rank's sequence shard (sequence parallelism)."""
    return comm.scatter_to_sequence(output, group)
