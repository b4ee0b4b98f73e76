"""The Transformer's pieces, shared by the language model (`model/gpt.py`) and the vision encoder
(`model/vision.py`): attention (and the gated attention; multi-latent attention is `model/mla.py`), the layers
(pre-norm blocks, or the residual sublayers of a layer pattern) and their stack; rotary positions are
`model/rotary.py`, the norms `model/norms.py`. Plain single-device
PyTorch; head counts are derived from weight shapes (`view(B, T, -1, head_dim)`), so tensor parallelism can swap
`nn.Linear` for its sharded twins without touching this file.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.attention import AttentionCore, LayerCache, LayerCaches, TokenPlaces, make_pattern
from paratron.model.layer_kind import (
    CheckpointNames,
    Column,
    ContextParallel,
    DecodeState,
    KindWork,
    LayerKind,
    MicroBatchShare,
    PartialGradient,
    Random,
    Row,
    Split,
)
from paratron.model.mla import MultiLatentAttention
from paratron.model.mlp import MLP, Projections
from paratron.model.moe import MoELayer
from paratron.model.norms import make_norm
from paratron.model.rotary import fused_rotation

# ---------------------------------------------------------------- attention


class Attention(LayerKind):
    """Self-attention of the configured pattern (causal, sliding window, ...: `model/attention.py`);
    grouped-query when there are fewer key/value heads than query heads. `layer_number` (from 1, as
    Megatron-LM numbers layers) divides the scores under --apply-query-key-layer-scaling."""

    symbol, kind_name, slot = "*", "attention", "attention"
    sees_positions = True
    context_parallel = ContextParallel.ATTENTION_CORE
    decode_state = DecodeState.KEY_VALUE
    selective_recompute = ("core",)
    projections: tuple[str, ...] = ("q", "k", "v")
    """The input projections, in the order of their rows in the one matmul."""

    # (its names in checkpoints)
    checkpoint_names = CheckpointNames(
        hf_module="self_attn",
        hf_norm="input_layernorm",
        hf_weights={
            "in_proj.{p}.{w}": "{p}_proj.{w}",
            "out_proj.weight": "o_proj.weight",
            "{p}_norm.weight": "{p}_norm.weight",
        },
        megatron_module="self_attention",
        megatron_norm="input_layernorm",
        megatron_fused_norm="linear_qkv.layer_norm",
        megatron_children={
            "out_proj": "linear_proj",
            "in_proj": "linear_qkv",
            "q_norm": "q_layernorm",
            "k_norm": "k_layernorm",
        },
    )

    def __init__(self, config: ModelConfig, layer_number: int = 1) -> None:
        super().__init__()
        heads = config.num_attention_heads
        groups = config.num_query_groups
        self.head_dim = config.kv_channels
        bias = config.add_bias_linear
        self.in_proj = Projections(config.hidden_size, self.projection_widths(config), bias or config.add_qkv_bias)
        self.out_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.core = AttentionCore(
            make_pattern(config),
            config.attention_dropout,
            layer_scaling=layer_number if config.apply_query_key_layer_scaling else None,
        )
        self.rotary_interleaved = config.rotary_interleaved
        self.rope_fusion = config.apply_rope_fusion
        self.output_dropout = nn.Dropout(config.hidden_dropout)
        # (--qk-layernorm: each head's queries and keys normalized, as Qwen3's q_norm / k_norm)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_layernorm else None
        self.heads = {"q": (self.head_dim, heads), "k": (self.head_dim, groups), "v": (self.head_dim, groups)}

    @classmethod
    def projection_widths(cls, config: ModelConfig) -> dict[str, int]:
        """Each input projection's output width."""
        head_dim = config.kv_channels
        heads = config.num_attention_heads
        groups = config.num_query_groups
        return {"q": heads * head_dim, "k": groups * head_dim, "v": groups * head_dim}

    def tensor_parallel_plan(self) -> dict[str, Split]:
        """Projections by heads (key/value heads replicated when fewer than the ranks), the output row-parallel,
        the core on this rank's heads under the tensor-parallel random stream; the query/key norms whole, each
        rank normalizing its own heads."""
        plan: dict[str, Split] = {"in_proj": Column(self.heads), "out_proj": Row(), "core": Random()}
        plan |= {name: PartialGradient() for name in ("q_norm", "k_norm") if getattr(self, name) is not None}
        return plan | {"output_dropout": Random(sequence_parallel_only=True)}

    def query_projection(self) -> nn.Module:
        return self.in_proj["q"]

    @classmethod
    def matmul_weights(cls, config: ModelConfig) -> int:
        widths = cls.projection_widths(config)
        return config.hidden_size * (sum(widths.values()) + config.num_attention_heads * config.kv_channels)

    @classmethod
    def attention_width(cls, config: ModelConfig) -> int:
        return config.num_attention_heads * config.kv_channels

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        q, k, v, *extra = self.in_proj(x)
        if rotary is not None or self.q_norm is not None:
            # (v is a slice of the projections' one output: kept alone for backward, it would keep the unrotated
            # queries and keys alive beside their rotated copies)
            v = v.contiguous()
        B, T = q.shape[:2]  # (not x's: with sequence parallelism x holds only part of the sequence)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, groups, T, hd]
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = fused_rotation(self.rope_fusion, q, k, *rotary, self.rotary_interleaved)
        if cache is not None:
            k, v = cache.update(k, v)
        y = self.core(q, k, v, places).transpose(1, 2).reshape(B, T, -1)
        return self.output_dropout(self.out_proj(self.gated(y, extra)))

    def gated(self, y: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
        """The attention output [B, T, heads x head width] before the output projection (as it is, here)."""
        return y

    # ------------------------------------------------------------ the planner's terms

    @classmethod
    def activation_bytes(cls, config: ModelConfig, share: MicroBatchShare, selective: bool) -> float:
        """Per token (a, g: this rank's query and key/value heads, d: head width, w: bytes of the compute type):
        queries w·a·d, keys and values 2·w·g·d (every CP rank's under the all-gather), the output w·a·d, the
        log-sum-exp 4a (the fused kernels keep nothing of size s²; selective recomputation drops it); under CP the
        output's copy laid out for the projection; the reference kernel with attention dropout (the CPU) its fp32
        probabilities, their mask and the dropped ones. Plus the output dropout's mask."""
        w, d = share.width, config.kv_channels
        a, g = config.num_attention_heads // share.tp, max(config.num_query_groups // share.tp, 1)
        keys_values = 2 * w * g * d * (share.cp if share.cp_gather else 1)
        per_token = w * a * d + keys_values + w * a * d  # queries, keys and values, output
        if not selective:
            per_token += 4 * a  # log-sum-exp
        if share.cp > 1:
            per_token += w * a * d  # the output laid out for the projection
        if config.attention_dropout > 0 and not share.flash_with_dropout and not selective:
            per_token += 12 * a * share.keys + (4 - w) * (a + 2 * g) * d
        return per_token * share.tokens + share.output_dropout(config)

    @classmethod
    def forward_work(cls, config: ModelConfig, share: MicroBatchShare) -> KindWork:
        """The query and output projections (/ TP), the key/value ones (replicated when fewer heads than ranks), and
        the scores and their product with the values over the keys each query computes."""
        h, heads, head_dim, tp = config.hidden_size, config.num_attention_heads, config.kv_channels, share.tp
        kv_per_rank = max(config.num_query_groups / tp, 1)  # replicated when fewer than TP ranks
        linear = 2 * share.tokens * h * head_dim * (2 * heads / tp + 2 * kv_per_rank)
        scores = 4 * share.tokens * share.computed_keys * heads * head_dim / tp
        return KindWork(linear, scores)


class GatedAttention(Attention):
    """Attention whose output is gated per feature by a sigmoid of the layer's input (--attention-output-gate;
    the full-attention layers of Qwen3-Next): y x sigmoid(x W_gate) before the output projection. The gate is a
    fourth input projection, one row per query feature, so it splits by heads exactly as the queries do."""

    projections = ("q", "k", "v", "gate")

    def __init__(self, config: ModelConfig, layer_number: int = 1) -> None:
        super().__init__(config, layer_number)
        self.heads = self.heads | {"gate": self.heads["q"]}

    @classmethod
    def projection_widths(cls, config: ModelConfig) -> dict[str, int]:
        widths = super().projection_widths(config)
        return widths | {"gate": widths["q"]}

    def gated(self, y: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
        (gate,) = extra
        return y * torch.sigmoid(gate)

    # ------------------------------------------------------------ the planner's terms

    @classmethod
    def activation_bytes(cls, config: ModelConfig, share: MicroBatchShare, selective: bool) -> float:
        """Attention's, and per token the gate's sigmoid and the gated output the projection keeps (2·w·a·d); where
        the projections' one output is kept whole (no rotary tables, or query/key norms over its views), the gate's
        rows of it too (w·a·d)."""
        a, d = config.num_attention_heads // share.tp, config.kv_channels
        copies = 2 if config.position_embedding_type == "rope" and not config.qk_layernorm else 3
        gate = copies * share.width * a * d * share.tokens
        return super().activation_bytes(config, share, selective) + gate

    @classmethod
    def forward_work(cls, config: ModelConfig, share: MicroBatchShare) -> KindWork:
        """Attention's, and the gate's projection (heads x head width rows, / TP as the queries)."""
        work = super().forward_work(config, share)
        heads = config.num_attention_heads
        gate = 2 * share.tokens * config.hidden_size * config.kv_channels * heads / share.tp
        return KindWork(work.linear + gate, work.scores, work.all_to_all)


def attention_kind(config: ModelConfig) -> type[Attention | MultiLatentAttention]:
    """The attention layers' kind: gated with --attention-output-gate, multi-latent with --multi-latent-attention
    (`model/mla.py`)."""
    if config.multi_latent_attention:
        return MultiLatentAttention
    return GatedAttention if config.attention_output_gate else Attention


# ---------------------------------------------------------------- block and model


KindT = TypeVar("KindT", bound=LayerKind)


class Residual(nn.Module):
    """What the layers of the stack have in common: residual sublayers x + kind(norm(x)), run in order.
    `residual_slots` names each: (its norm's attribute, its kind's attribute). The parallel swaps, recomputation,
    compilation and the inference engine reach a layer's kinds through `kinds()`, never by a child's name."""

    residual_slots: tuple[tuple[str, str], ...] = ()

    def kinds(self) -> dict[str, LayerKind]:
        """The layer's kinds by their attribute (`attention`, `mlp`), in order."""
        return {kind: getattr(self, kind) for _, kind in self.residual_slots}

    def norms(self) -> list[nn.Module]:
        """The norms in front of the kinds."""
        return [getattr(self, norm) for norm, _ in self.residual_slots]

    def kind_of(self, kind: type[KindT]) -> KindT | None:
        """The layer's first kind that is a `kind` (its parallel twins included), if any."""
        return next((k for k in self.kinds().values() if isinstance(k, kind)), None)


class TransformerBlock(Residual):
    """Pre-norm Transformer block: x + attention(norm(x)), then x + mlp(norm(x)); in an MoE layer the
    MLP is a mixture of experts (`model/moe.py`). The layer of a model built from --num-layers."""

    residual_slots = (("attention_norm", "attention"), ("mlp_norm", "mlp"))

    def __init__(self, config: ModelConfig, moe: bool = False, layer_number: int = 1) -> None:
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = attention_kind(config)(config, layer_number)
        self.mlp_norm = make_norm(config)
        self.mlp = MoELayer(config) if moe else MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rotary, cache, places)
        return x + self.mlp(self.mlp_norm(x))


class PatternLayer(Residual):
    """One residual sublayer of a --hybrid-layer-pattern: x + kind(norm(x)), its weights under `norm` and the
    kind's slot (`attention` or `mlp`)."""

    def __init__(self, config: ModelConfig, symbol: str, layer_number: int = 1) -> None:
        super().__init__()
        kind_class = _symbol_kinds(config)[symbol]
        numbered = issubclass(kind_class, (Attention, MultiLatentAttention))
        kind = kind_class(config, layer_number) if numbered else kind_class(config)
        self.norm = make_norm(config)
        self.add_module(kind.slot, kind)
        self.residual_slots = (("norm", kind.slot),)
        self.slot, self.sees_positions = kind.slot, kind.sees_positions

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        kind = getattr(self, self.slot)
        h = self.norm(x)
        return x + (kind(h, rotary, cache, places) if self.sees_positions else kind(h))


def _symbol_kinds(config: ModelConfig) -> dict[str, type[LayerKind]]:
    """The kind each symbol of --hybrid-layer-pattern builds."""
    return {"*": attention_kind(config), "-": MLP, "E": MoELayer}


def build_layers(config: ModelConfig) -> list[Residual]:
    """The model's layers: one per symbol of --hybrid-layer-pattern, or --num-layers Transformer blocks."""
    if config.layer_pattern is not None:
        symbols = config.layer_pattern.symbols
        return [PatternLayer(config, symbol, number) for number, symbol in enumerate(symbols, start=1)]
    return [TransformerBlock(config, moe, number) for number, moe in enumerate(config.moe_layer_pattern, start=1)]


def layer_kinds(config: ModelConfig) -> list[tuple[type[LayerKind], ...]]:
    """The kinds of each layer `build_layers` makes, without building them (for FLOPs and memory estimates)."""
    if config.layer_pattern is not None:
        kinds = _symbol_kinds(config)
        return [(kinds[symbol],) for symbol in config.layer_pattern.symbols]
    return [(attention_kind(config), MoELayer if moe else MLP) for moe in config.moe_layer_pattern]


class TransformerLayers(nn.ModuleList):
    """The stack of blocks. `forward` runs a contiguous range of them in order: all of them in
    the whole model, its own layers in a pipeline stage. (A module of its own, so that
    recomputation can swap in a stack that recomputes groups of layers.)"""

    def forward(
        self,
        x: torch.Tensor,
        indices: range,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCaches | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        for i in indices:
            x = self[i](x, rotary, cache.layers[i] if cache is not None else None, places)
        return x
