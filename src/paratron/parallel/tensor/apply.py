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

from paratron.config.schema import ModelConfig
from paratron.distributed import comm
from paratron.distributed.rng import TENSOR_PARALLEL, Forked, RNGStates
from paratron.distributed.topology import RankGroup
from paratron.model.gpt import GPT
from paratron.model.moe import MoELayer
from paratron.model.vision import encoder_layer_config
from paratron.parallel.sharding import set_partial_grad
from paratron.parallel.tensor.layers import (
    ColumnParallelLinear,
    ColumnParallelProjections,
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
    config = model.config
    for block in model.layers:
        _split_block(block, config, tp, rng, kv_replica_group)
    if model.vision is not None:  # (the encoder's layers split as the language model's, never by sequence)
        whole, layer_config = dataclasses.replace(tp, sequence_parallel=False), encoder_layer_config(config)
        for block in model.vision.encoder.layers:
            _split_block(block, layer_config, whole, rng, None)
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


def _split_block(
    block: nn.Module, config: ModelConfig, tp: TPContext, rng: RNGStates | None, kv_replica_group: RankGroup | None
) -> None:
    """One block's attention and (dense) MLP swapped for their tensor-parallel twins, in place."""
    head_dim = config.kv_channels
    groups = config.num_query_groups

    def forked(module: nn.Module) -> nn.Module:
        return _forked(module, rng)

    heads = {"q": (head_dim, config.num_attention_heads), "k": (head_dim, groups), "v": (head_dim, groups)}
    attention = block.attention
    attention.in_proj = ColumnParallelProjections(attention.in_proj, tp, heads)
    if groups < tp.size:  # a replicated key/value head: its gradient is split over the replicas
        for name in ("k", "v"):
            for param in _replicated_rows(attention.in_proj[name]):
                set_partial_grad(param, kv_replica_group)
    attention.out_proj = RowParallelLinear(attention.out_proj, tp)
    attention.core = forked(attention.core)
    for norm in (attention.q_norm, attention.k_norm):  # (each rank normalizes its own heads)
        for param in norm.parameters() if norm is not None else ():
            set_partial_grad(param, tp.group)

    mlp = block.mlp
    dense = not isinstance(mlp, MoELayer)  # (MoE layers are split by parallel/expert)
    if dense:
        mlp.in_proj = ColumnParallelProjections(mlp.in_proj, tp, {})
        mlp.out_proj = RowParallelLinear(mlp.out_proj, tp)

    if tp.sequence_parallel:
        for norm in (block.attention_norm, block.mlp_norm):
            for param in norm.parameters():
                set_partial_grad(param, tp.group)
        attention.output_dropout = forked(attention.output_dropout)
        if dense:
            mlp.dropout = forked(mlp.dropout)


def _forked(module: nn.Module, rng: RNGStates | None) -> nn.Module:
    """`module` run under the tensor-parallel random stream (dropout that differs across TP ranks)."""
    return Forked(module, rng, TENSOR_PARALLEL) if rng is not None else module


def _to_sequence_shard(module: nn.Module, inputs: tuple, output: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """A forward hook: the merged embeddings [B, T, width] cut to this rank's sequence shard (sequence parallelism)."""
    return comm.scatter_to_sequence(output, group)
