"""Layer kinds: what a residual sublayer of the model is, and everything the rest of paratron asks of it.

A layer of the model is a residual sublayer `x + kind(norm(x))` of one kind: attention (`*`), an MLP (`-`), a
mixture of experts (`E`). A kind is an `nn.Module` subclass of `LayerKind` that declares, next to its forward:

    tensor_parallel_plan()  how its weights split over tensor-parallel ranks, child by child: `Column` (output rows;
                            per-head groups for projections), `Row` (input columns), `PartialGradient` (whole on
                            every rank, each rank's gradient a partial sum: the norms of its own heads), `Random`
                            (draws under the tensor-parallel random stream); nothing: whole and replicated
    context_parallel        how it runs when the sequence is split over ranks: token by token (nothing to exchange),
                            its attention core swapped for one that attends across the ranks, its router counting
                            over the whole sequence; or `context_parallel_refusal`, the reason it refuses
    decode_state            what it keeps between decoding steps (a key/value cache, nothing)
    selective_recompute     the children that --recompute-granularity selective recomputes
    matmul_weights(), attention_width()
                            the weights one token's matmuls go through and the width of its attention scores, for
                            model FLOPs and MFU (`training.flops`)
    checkpoint_names        its weights' names, and the name of the norm in front of it, in Hugging Face checkpoints
                            (Llama's convention) and Megatron-LM's (`CheckpointNames`)

The tensor-parallel swap (`parallel.tensor.apply`), context parallelism, recomputation, compiled regions, the debug
capture, the inference engine, the FLOPs count and the checkpoint converters read these declarations; none of them
names a kind's children.
docs/extending.md ("How to add a layer kind") walks through adding one.

The model's stack of layers is a pattern (`--hybrid-layer-pattern`, read by `config.layer_pattern`): one symbol per
residual sublayer. Without a pattern, `--num-layers N` is N Transformer blocks, each the pair `*-` (or `*E` in an
MoE layer), under the block's own names (`model.transformer`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from torch import nn

if TYPE_CHECKING:
    from paratron.config.schema import ModelConfig

# ---------------------------------------------------------------- how weights split under tensor parallelism


@dataclass(frozen=True)
class Column:
    """Output rows split over the tensor-parallel ranks. For a `Projections` module, `heads` gives each projection's
    (head width, heads): rows split by whole heads, a projection with fewer heads than ranks replicated (its
    gradient summed over the ranks that hold the same heads). An empty `heads` splits every projection evenly."""

    heads: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """Input columns split over the tensor-parallel ranks; the outputs summed (or reduce-scattered by sequence)."""


@dataclass(frozen=True)
class PartialGradient:
    """Whole on every rank, but each rank's gradient covers only its share (the norms of its own heads): summed over
    the tensor-parallel group."""


@dataclass(frozen=True)
class Random:
    """Draws under the tensor-parallel random stream: each rank's heads get their own dropout masks. With
    `sequence_parallel_only`, only when the activations are split by sequence (dropout after a row-parallel layer)."""

    sequence_parallel_only: bool = False


Split = Column | Row | PartialGradient | Random


# ---------------------------------------------------------------- context parallelism and decoding


class ContextParallel(enum.Enum):
    """How a kind runs when each rank holds part of the sequence."""

    TOKENWISE = "tokenwise"
    """Each token on its own (an MLP): nothing to exchange."""
    ATTENTION_CORE = "attention core"
    """Its `core` child is swapped for attention across the context-parallel ranks."""
    SEQUENCE_ROUTER = "sequence router"
    """Tokenwise, but its router's load-balancing losses count the experts chosen over the whole sequence."""


class DecodeState(enum.Enum):
    """What a kind keeps between decoding steps."""

    NONE = "none"
    KEY_VALUE = "key/value cache"
    """The keys and values of every position so far; the engine swaps its `core` for paged attention."""


# ---------------------------------------------------------------- names in other frameworks' checkpoints


@dataclass(frozen=True)
class CheckpointNames:
    """Where a kind's weights live in Hugging Face and Megatron-LM checkpoints, below its layer (the converters put
    the layer's own prefix in front). The Hugging Face names are Llama's convention, which every converted family
    follows but GPT-2 (its own names throughout) and Mixtral (its experts'); `checkpoint.hf.families` states those
    differences beside the families' rows."""

    hf_module: str
    """Its module in a Hugging Face layer (`self_attn`, `mlp`)."""
    hf_norm: str
    """The Hugging Face name of the norm in front of it (`input_layernorm`, `post_attention_layernorm`)."""
    hf_weights: Mapping[str, str]
    """Its tensors (below the kind; projection {p}, weight or bias {w}) -> theirs below `hf_module`."""
    megatron_module: str
    """Its module in a megatron-core layer (`self_attention`, `mlp`)."""
    megatron_norm: str
    """The megatron-core name of the norm in front of it as its own module (the local spec: `input_layernorm`)."""
    megatron_fused_norm: str | None
    """That norm under Transformer Engine's spec, fused into its first linear layer (`linear_qkv.layer_norm`, whose
    tensors are `layer_norm_weight` and `layer_norm_bias`); None: it stays its own module."""
    megatron_children: Mapping[str, str]
    """Its children (or tensors) -> theirs below `megatron_module`, in megatron-core's registration order. Megatron
    fuses an `in_proj` into one linear layer: an attention's q, k and v interleaved per query group (`linear_qkv`),
    an MLP's [gate; up] (`linear_fc1`); `checkpoint.megatron.tensor_layout` fuses and splits them."""
    hf_experts: tuple[str, ...] = ()
    """One expert's (gate, up, down) weights below `hf_module` (expert {e}), which paratron stacks."""


# ---------------------------------------------------------------- the interface


class LayerKind(nn.Module):
    """A residual sublayer's kind (see the module docstring). Subclasses set the class attributes and override
    what differs from the defaults: replicated weights, tokenwise, nothing kept while decoding, nothing recomputed
    selectively, no matmuls."""

    symbol: ClassVar[str] = ""
    """Its symbol in --hybrid-layer-pattern."""
    kind_name: ClassVar[str] = ""
    """Its name in messages."""
    slot: ClassVar[str] = ""
    """The attribute it lives under in its layer (`attention`, `mlp`), which names its weights in checkpoints."""
    sees_positions: ClassVar[bool] = False
    """Its forward takes (x, rotary tables, its decoding cache, the tokens' places); else (x) alone."""
    context_parallel: ClassVar[ContextParallel] = ContextParallel.TOKENWISE
    context_parallel_refusal: ClassVar[str | None] = None
    """Why it cannot run with the sequence split over ranks (None: it can)."""
    decode_state: ClassVar[DecodeState] = DecodeState.NONE
    selective_recompute: ClassVar[tuple[str, ...]] = ()
    """Children that selective recomputation runs again in backward (their saved activations grow fastest)."""
    checkpoint_names: ClassVar[CheckpointNames]
    """Its names in Hugging Face and Megatron-LM checkpoints (every kind declares them)."""

    def tensor_parallel_plan(self) -> dict[str, Split]:
        """Child name -> how it splits over tensor-parallel ranks (children not named stay whole)."""
        return {}

    def query_projection(self) -> nn.Module | None:
        """The child whose output rows are the query heads (how the debug capture lays out the core's heads)."""
        return None

    @classmethod
    def matmul_weights(cls, config: ModelConfig) -> int:
        """Weights of the matrix multiplies one token goes through in this kind (active ones only)."""
        return 0

    @classmethod
    def attention_width(cls, config: ModelConfig) -> int:
        """Heads x head width of the attention scores it computes per token (0: none)."""
        return 0
