"""Layer kinds: what a residual sublayer of the model is, and everything the rest of paratron asks of it.

A layer of the model is a residual sublayer `x + kind(norm(x))` of one kind: attention (`*`), an MLP (`-`), a
mixture of experts (`E`). A kind is an `nn.Module` subclass of `LayerKind` that declares, next to its forward:

    tensor_parallel_plan()  how its weights split over tensor-parallel ranks, child by child: `Column` (output rows;
                            per-head groups for projections), `Row` (input columns), `PartialGradient` (whole on
                            every rank, each rank's gradient a partial sum: the norms of its own heads),
                            `ColumnInput` (an identity that enters the heads' region), `Random` (draws under the
                            tensor-parallel random stream); nothing: whole and replicated
    context_parallel        how it runs when the sequence is split over ranks: token by token (nothing to exchange),
                            its attention core swapped for one that attends across the ranks, its router counting
                            over the whole sequence; or `context_parallel_refusal`, the reason it refuses
    decode_state            what it keeps between decoding steps (a key/value cache, nothing)
    selective_recompute     the children that --recompute-granularity selective recomputes
    matmul_weights(), attention_width()
                            the weights one token's matmuls go through and the width of its attention scores, for
                            model FLOPs and MFU (`training.flops`)
    activation_bytes(), forward_work()
                            what it saves for backward and the forward FLOPs it runs for one rank's share of a
                            micro-batch (`MicroBatchShare`), which the planner sums over the layers each pipeline
                            stage holds (`planning.activations`, `planning.operations`)
    checkpoint_names        its weights' names, and the name of the norm in front of it, in Hugging Face checkpoints
                            (Llama's convention) and Megatron-LM's (`CheckpointNames`)

The tensor-parallel swap (`parallel.tensor.apply`), context parallelism, recomputation, compiled regions, the debug
capture, the inference engine, the FLOPs count, the planner and the checkpoint converters read these declarations;
none of them names a kind's children.
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
    the tensor-parallel group. With `sequence_parallel_only`, only when the activations are split by sequence (a
    replicated layer in front of the column-parallel ones, as multi-latent attention's down-projections: each rank
    then sees its own tokens)."""

    sequence_parallel_only: bool = False


@dataclass(frozen=True)
class ColumnInput:
    """An identity where a replicated activation enters per-head work without passing a column-parallel layer
    (multi-latent attention's rotary key, which every head shares): under tensor parallelism it becomes what a
    column-parallel layer does to its input, Megatron-LM's copy to the tensor-parallel region (backward: the ranks'
    gradients summed) or, under sequence parallelism, the gather of the sequence shards (backward: reduce-scatter)."""


@dataclass(frozen=True)
class Random:
    """Draws under the tensor-parallel random stream: each rank's heads get their own dropout masks. With
    `sequence_parallel_only`, only when the activations are split by sequence (dropout after a row-parallel layer)."""

    sequence_parallel_only: bool = False


Split = Column | Row | PartialGradient | ColumnInput | Random


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


# ---------------------------------------------------------------- what the planner prices a kind against


@dataclass(frozen=True)
class MicroBatchShare:
    """One rank's share of a micro-batch, as the planner sees it: the kinds price their saved activations and their
    forward work against it (`LayerKind.activation_bytes`, `LayerKind.forward_work`). The planner builds it from the
    layout and the device's kernels; the model only reads it."""

    tokens: float
    """Micro-batch x sequence / CP: the tokens this rank's layers see."""
    seq: int
    """Sequence / CP."""
    keys: int
    """Keys a query attends to (the s x s terms of attention that keeps its probabilities)."""
    computed_keys: float
    """Keys per query the attention kernels compute (causal masking skips the upper triangle): the scores' work."""
    width: int
    """Bytes per element of the compute type."""
    tp: int
    expert_tp: int
    sp: bool
    """Sequence parallelism: the replicated parts (a layer's input and output) are split by sequence over TP."""
    cp: int
    cp_gather: bool
    """Context parallelism by all-gather: every rank keeps every rank's keys and values."""
    mask_bytes: int | None = None
    """Bytes per element of a dropout mask (None: those of the compute type, as on the CPU)."""
    flash_with_dropout: bool = False
    """Attention with dropout still runs a fused kernel (nothing of size s x s kept)."""
    composite_rms_norm: bool = False
    """RMSNorm runs as separate operations in fp32 (the CPU), keeping fp32 copies (a kind's own norms)."""

    @property
    def sharded_tokens(self) -> float:
        """Tokens of the replicated parts (norms, layer inputs and outputs): / TP under sequence parallelism."""
        return self.tokens / self.tp if self.sp else self.tokens

    @property
    def mask(self) -> int:
        """Bytes per element of a dropout mask."""
        return self.mask_bytes or self.width

    def output_dropout(self, config: ModelConfig) -> float:
        """The mask of the dropout on a kind's output (--hidden-dropout), over the layer's replicated tokens."""
        return self.mask * config.hidden_size * self.sharded_tokens if config.hidden_dropout > 0 else 0.0


@dataclass(frozen=True)
class KindWork:
    """A kind's forward FLOPs for one rank's share of a micro-batch (the planner prices backward from them)."""

    linear: float
    """Matmuls with weights (backward: twice as much, half of it for the weights)."""
    scores: float = 0.0
    """Attention scores and their product with the values, over the keys each query computes."""
    all_to_all: bool = False
    """Its tokens are dispatched to their experts and combined through all-to-alls (expert parallelism)."""


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

    # ------------------------------------------------------------ the planner's terms

    @classmethod
    def activation_bytes(cls, config: ModelConfig, share: MicroBatchShare, selective: bool) -> float:
        """Bytes it saves for backward over one rank's share of a micro-batch, its norm aside (the residual layer's,
        which the planner prices); `selective`: under --recompute-granularity selective. Every kind declares it."""
        raise NotImplementedError(f"{cls.__name__} declares no activation_bytes: the planner cannot price it")

    @classmethod
    def forward_work(cls, config: ModelConfig, share: MicroBatchShare) -> KindWork:
        """Its forward FLOPs over one rank's share of a micro-batch. Every kind declares it."""
        raise NotImplementedError(f"{cls.__name__} declares no forward_work: the planner cannot price it")
