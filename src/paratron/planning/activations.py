"""The activations a rank keeps for backward, from the tensors each layer saves.

The count follows the tensors autograd saves, each storage once, as `--log-memory`'s meter
(`training/memory_report.py`) sees them; docs/memory.md derives each term and docs/planning.md gives
the measured error. A layer is priced from its kinds (`planning.layer_terms`): each kind declares what it saves for one
rank's share of a micro-batch (`LayerKind.activation_bytes`: attention, gated attention, the MLP, the mixture of
experts, each with its output dropout's mask), and each residual sublayer adds its norm here (a Transformer block
two, a --hybrid-layer-pattern layer one). Per token of a micro-batch on this rank (n = micro-batch x sequence / CP
tokens; w = bytes of the compute type; t = TP; a, g = query and key/value heads of this rank, d = head width,
f = MLP width / t; a norm's tokens and the layer input are / t under sequence parallelism):

    norm           RMSNorm: 4h fp32 input + 4h normalized + 4 rstd + wh output where the
                   kernel is composite (CPU); wh + 4 + wh where it is fused. LayerNorm: wh
                   input + 2 statistics + wh output
    attention      queries w·a·d, keys and values 2·w·g·d, output w·a·d, log-sum-exp 4a (the
                   fused kernels keep nothing of size s²); CP ring: + the output's copy w·a·d;
                   CP all-gather: every rank's keys and values (2·w·g·d·CP) instead of its own;
                   CPU with attention dropout (the reference kernel): + 12·a·keys for the
                   probabilities, their mask and the dropped ones in fp32; an output gate: + its sigmoid
                   and the gated output 2·w·a·d (+ its rows of the projections' output, w·a·d, where that
                   is kept whole)
    MLP            SwiGLU: gate, up, silu(gate), their product, 4·w·f; GELU: its input and output, 2·w·f
    dropout        a mask per dropout (w bytes per element on the CPU, 1 on CUDA)

Recomputation: selective keeps the attention core's inputs but not its log-sum-exp; full keeps
each group's input (w·h per token) and recomputes the rest in backward. The first stage adds the
token ids (8 per token; under TP the local ids and a mask), learned positions (8 per position),
and every stage the rotary tables (2 x 4 x s x d per micro-batch); the last stage the final norm
and the loss: the fp32 log-probabilities (4V, V the vocabulary of this rank) and the labels. A
vision model's first stage adds the encoder's and projector's for the micro-batch's images
(`vision_bytes`; --plan-images-per-sample per sample): its layers priced as the language model's
with the encoder's shapes (split by TP, never by sequence), recomputed alike.

Under pipeline parallelism a rank holds several micro-batches at once: the peak is found by
walking its schedule, adding a chunk's bytes at each forward and releasing them at its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from paratron.config.layout import Layout
from paratron.config.schema import Config, ModelConfig
from paratron.model.fused_loss import chunk_tokens
from paratron.model.layer_kind import MicroBatchShare
from paratron.model.mlp import MLP
from paratron.model.transformer import attention_kind
from paratron.model.vision import encoder_layer_config
from paratron.parallel.pipeline.schedules import stage_of
from paratron.parallel.tensor.layers import padded_vocab_size
from paratron.planning.layer_terms import WIDTHS, LayerKinds, computed_keys, distinct_layers, model_layer_kinds
from paratron.planning.live import schedule_peak
from paratron.planning.vision import images_per_micro_batch
from paratron.training.flops import attended_keys


def grad_width(config: Config) -> int:
    """Bytes per element of the data-parallel gradients as accumulated and reduced: 4 (fp32), or 2 with
    --grad-reduce-in-bf16."""
    return 2 if config.parallel.grad_reduce_in_bf16 else 4


@dataclass(frozen=True)
class Kernels:
    """What a device's kernels keep for backward where they differ."""

    name: str
    composite_rms_norm: bool
    """RMSNorm runs as separate operations in fp32 (the CPU), keeping fp32 copies."""
    mask_bytes: int | None
    """Bytes per element of a dropout mask (None: those of the compute type, as on the CPU)."""
    flash_with_dropout: bool
    """Attention with dropout still runs a fused kernel (no s x s tensors kept)."""
    fp32_norm_statistics: bool
    """LayerNorm keeps its mean and rstd in fp32 whatever the compute type."""


CPU = Kernels("cpu", composite_rms_norm=True, mask_bytes=None, flash_with_dropout=False, fp32_norm_statistics=False)
CUDA = Kernels("cuda", composite_rms_norm=False, mask_bytes=1, flash_with_dropout=True, fp32_norm_statistics=True)
KERNELS = {"cpu": CPU, "cuda": CUDA}


@dataclass(frozen=True)
class _Shape:
    """One rank's share of a micro-batch and of each layer."""

    model: ModelConfig
    tokens: int  # micro-batch x sequence / CP
    seq: int  # sequence / CP
    keys: int  # keys a query attends to (for the s x s terms)
    w: int
    tp: int
    expert_tp: int
    sp: bool
    cp: int
    cp_gather: bool
    kernels: Kernels
    fused_loss: bool = False  # --cross-entropy-loss-fusion: the last stage's output layer and loss in chunks

    @property
    def h(self) -> int:
        return self.model.hidden_size

    @property
    def head_dim(self) -> int:
        return self.model.kv_channels

    @property
    def groups(self) -> int:
        groups = self.model.num_query_groups
        return max(groups // self.tp, 1)

    @property
    def sharded_tokens(self) -> float:
        """Tokens of the replicated parts (norms, layer inputs): / TP under sequence parallelism."""
        return self.tokens / self.tp if self.sp else self.tokens

    @property
    def mask(self) -> int:
        return self.kernels.mask_bytes or self.w

    @cached_property
    def share(self) -> MicroBatchShare:
        """The same share as the layer kinds price against (`LayerKind.activation_bytes`)."""
        return MicroBatchShare(
            tokens=self.tokens,
            seq=self.seq,
            keys=self.keys,
            computed_keys=computed_keys(self.model, self.seq * self.cp),
            width=self.w,
            tp=self.tp,
            expert_tp=self.expert_tp,
            sp=self.sp,
            cp=self.cp,
            cp_gather=self.cp_gather,
            mask_bytes=self.kernels.mask_bytes,
            flash_with_dropout=self.kernels.flash_with_dropout,
            composite_rms_norm=self.kernels.composite_rms_norm,
        )


def _norm(shape: _Shape) -> float:
    h, w = shape.h, shape.w
    if shape.model.normalization == "RMSNorm":
        per_token = 8 * h + 4 + w * h if shape.kernels.composite_rms_norm else 2 * w * h + 4
    else:
        statistic = 4 if shape.kernels.fp32_norm_statistics else w
        per_token = 2 * w * h + 2 * statistic
    return per_token * shape.sharded_tokens


def layer_bytes(shape: _Shape, kinds: LayerKinds, selective: bool) -> float:
    """One layer's saved activations for one micro-batch: a norm per residual sublayer and what each of its kinds
    declares (`LayerKind.activation_bytes`)."""
    total = len(kinds) * _norm(shape)
    for kind in kinds:
        total += kind.activation_bytes(shape.model, shape.share, selective)
    return total


def _recomputed_layer(config: Config, shape: _Shape) -> LayerKinds:
    """The layer full recomputation's group is priced by: one with experts where the model has them (what a rank's
    experts see moves with the routing), else the largest."""
    layers = distinct_layers(config.model)
    return max(
        layers,
        key=lambda kinds: (
            any(kind.forward_work(config.model, shape.share).all_to_all for kind in kinds),
            layer_bytes(shape, kinds, False),
        ),
    )


def _first_stage_bytes(shape: _Shape) -> float:
    m = shape.model
    ids = (8 + 1 if shape.tp > 1 else 8) * shape.tokens
    positions = 8 * shape.seq if m.position_embedding_type == "learned_absolute" else 0
    dropout = shape.mask * shape.h * shape.sharded_tokens if m.hidden_dropout > 0 else 0.0
    return ids + positions + dropout


def _last_stage_bytes(shape: _Shape, vocab: int) -> float:
    if shape.fused_loss:
        return _norm(shape) + fused_loss_kept(shape, vocab)
    labels = 8 + (2 if shape.tp > 1 else 0)  # the labels; under TP also which of them this rank holds
    return _norm(shape) + (4 * vocab / shape.tp + labels) * shape.tokens


def _rotary_bytes(shape: _Shape) -> float:
    return 2 * 4 * shape.seq * shape.head_dim if shape.model.position_embedding_type == "rope" else 0.0


def padded_vocab(config: Config, tp: int) -> int:
    """The output layer's rows over all TP ranks: the vocabulary padded to a multiple of
    --make-vocab-size-divisible-by x TP, on one rank too (`padded_vocab_size`)."""
    m = config.model
    return padded_vocab_size(m.vocab_size or 0, tp, m.make_vocab_size_divisible_by)


def shape_of(config: Config, layout: Layout, kernels: Kernels) -> _Shape:
    seq = config.data.seq_length // layout.cp
    return _Shape(
        model=config.model,
        tokens=config.training.micro_batch_size * seq,
        seq=seq,
        keys=attended_keys(config.model, config.data.seq_length),
        w=WIDTHS[config.training.precision],
        tp=layout.tp,
        expert_tp=config.parallel.expert_tensor_parallel_size or layout.tp,
        sp=config.parallel.sequence_parallel,
        cp=layout.cp,
        cp_gather=config.parallel.cp_comm_type == "all_gather",
        kernels=kernels,
        fused_loss=config.training.cross_entropy_loss_fusion,
    )


def _input_bytes(shape: _Shape) -> float:
    """A layer's input, which full recomputation keeps."""
    return shape.w * shape.h * shape.sharded_tokens


def _stack_bytes(config: Config, shape: _Shape, full: list[float]) -> tuple[float, int]:
    """A stack of layers' saved activations (`full`: each one's without full recomputation) under the
    recomputation settings, and how many of its layers are recomputed."""
    t, layers = config.training, len(full)
    if t.recompute_granularity != "full":
        return sum(full), 0
    group = t.recompute_num_layers or 1
    if t.recompute_method == "block":
        recomputed = min(group, layers)
        return recomputed * _input_bytes(shape) + sum(full[recomputed:]), recomputed
    return -(-layers // group) * _input_bytes(shape), layers


def chunk_bytes(config: Config, layout: Layout, shape: _Shape, stage: int) -> float:
    """One micro-batch's saved activations on model stage `stage` (all of the model without PP)."""
    t, kinds = config.training, model_layer_kinds(config.model)
    indices = layout.pipeline.ranges[stage]
    selective = t.recompute_granularity == "selective"
    priced = {layer: layer_bytes(shape, layer, selective) for layer in {kinds[i] for i in indices}}  # (each once)
    full = [priced[kinds[i]] for i in indices]
    kept, recomputed = _stack_bytes(config, shape, full)
    if recomputed < len(indices):  # (inside recomputed layers the rotary tables are not kept)
        kept += _rotary_bytes(shape)
    last = layout.pp * layout.pipeline.chunks - 1
    if stage == 0:
        kept += _first_stage_bytes(shape) + vision_bytes(config, layout, shape.kernels)
    if stage == last:
        kept += _last_stage_bytes(shape, padded_vocab(config, layout.tp))
    return kept


def vision_shape(config: Config, layout: Layout, kernels: Kernels) -> _Shape:
    """One rank's share of the encoder's layers for a micro-batch's images: split by TP, never by sequence."""
    m = config.model
    tokens = m.num_patches + int(m.class_token)
    return _Shape(
        model=encoder_layer_config(m),
        tokens=images_per_micro_batch(config, config.training.micro_batch_size) * tokens,
        seq=tokens,
        keys=tokens,
        w=WIDTHS[config.training.precision],
        tp=layout.tp,
        expert_tp=layout.tp,
        sp=False,
        cp=1,
        cp_gather=False,
        kernels=kernels,
    )


def vision_bytes(config: Config, layout: Layout, kernels: Kernels) -> float:
    """A micro-batch's activations of the vision encoder and projector (first stage): the pixels the patch
    embedding keeps, the norm before the layers, the layers that run (recomputed as the language model's), the
    projector's inputs and its activation, and the mask that places the features (a byte per token). A frozen
    encoder keeps nothing: no gradient passes through it."""
    m = config.model
    if not m.has_vision:
        return 0.0
    shape, w = vision_shape(config, layout, kernels), WIDTHS[config.training.precision]
    images = images_per_micro_batch(config, config.training.micro_batch_size)
    features = images * m.image_tokens
    projector = w * features * m.vision_hidden_size
    if m.vision_projection == "mlp":
        projector += 2 * w * features * m.hidden_size  # (GELU's input, the second linear's input)
    placed = config.training.micro_batch_size * config.data.seq_length
    if not m.encoder_trains:
        return projector + placed
    selective = config.training.recompute_granularity == "selective"
    block = (attention_kind(shape.model), MLP)  # (the encoder's layers are Transformer blocks)
    layers, _ = _stack_bytes(config, shape, [layer_bytes(shape, block, selective)] * m.vision_run_layers)
    pixels = w * images * 3 * m.img_h * m.img_w
    statistic = 4 if kernels.fp32_norm_statistics else w
    pre_norm = (w * shape.h + 2 * statistic) * shape.tokens if m.class_token else 0.0
    return pixels + pre_norm + layers + projector + placed


def activation_peak(config: Config, layout: Layout, pp_rank: int, kernels: Kernels) -> int:
    """Peak bytes of activations saved for backward on pipeline rank `pp_rank`: one micro-batch
    without pipeline parallelism; with it, the most its schedule holds at once."""
    shape = shape_of(config, layout, kernels)
    if layout.pp == 1:
        return round(chunk_bytes(config, layout, shape, 0))
    stages = rank_model_stages(layout, pp_rank)
    return schedule_peak(layout, pp_rank, [chunk_bytes(config, layout, shape, s) for s in stages])


def activation_peaks(config: Config, layout: Layout, kernels: Kernels) -> list[int]:
    """`activation_peak` of every pipeline rank, each kind of model stage sized once (most stages of a
    pipeline hold the same layers)."""
    shape = shape_of(config, layout, kernels)
    if layout.pp == 1:
        return [round(chunk_bytes(config, layout, shape, 0))]
    kinds, last = model_layer_kinds(config.model), layout.pp * layout.pipeline.chunks - 1
    sized: dict[tuple, float] = {}
    sizes = []
    for stage, indices in enumerate(layout.pipeline.ranges):
        kind = (kinds[indices.start : indices.stop], stage == 0, stage == last)
        if kind not in sized:
            sized[kind] = chunk_bytes(config, layout, shape, stage)
        sizes.append(sized[kind])
    return [schedule_peak(layout, r, [sizes[s] for s in rank_model_stages(layout, r)]) for r in range(layout.pp)]


def rank_model_stages(layout: Layout, pp_rank: int) -> list[int]:
    """The model stages pipeline rank `pp_rank` holds, one per chunk of its schedule."""
    plan = layout.pipeline
    v_shape = plan.schedule == "zb-v"  # (ZB-V: always two chunks, as a V)
    return [stage_of(pp_rank, c, layout.pp, v_shape) for c in range(2 if v_shape else plan.chunks)]


def buffer_bytes(
    config: Config, layout: Layout, pp_rank: int, kernels: Kernels, stage_elements: int, layer_elements: int
) -> int:
    """Transient memory at the step's peak that `--log-memory` does not count (it is not kept for
    backward): the logits and the loss's fp32 working copy on the last stage, pipeline send and
    receive buffers, sequence-parallel gathers, context-parallel blocks in flight, gradient buckets
    being reduced (ZeRO-2), FSDP's gathered layers (ZeRO-3: this one and the next, and one layer's
    unsharded gradients, in their reduction type), and the layer group full recomputation runs again in backward.
    `stage_elements`: parameters this rank trains; `layer_elements`: one layer's before ZeRO-3
    sharding."""
    shape = shape_of(config, layout, kernels)
    t, p, w = config.training, config.parallel, shape.w
    hidden = w * shape.h * shape.tokens
    total = 0.0
    last_rank = layout.pp - 1 if layout.pipeline.chunks == 1 or layout.pipeline.schedule != "zb-v" else 0
    if pp_rank == last_rank:
        vocab = padded_vocab(config, layout.tp)
        total += fused_loss_buffer(shape, vocab) if shape.fused_loss else (w + 4) * vocab / layout.tp * shape.tokens
    if layout.pp > 1:
        total += 2 * layout.pipeline.chunks * hidden / (layout.tp if p.sequence_parallel else 1)
    if p.sequence_parallel:
        total += hidden
    if layout.cp > 1 and p.cp_comm_type == "p2p":
        total += 2 * 2 * w * shape.groups * shape.head_dim * shape.tokens
    zero, g = p.zero_stage, grad_width(config)
    if zero == 2 and layout.dp * layout.cp > 1:
        total += g * min(2 * p.gradient_bucket_size(layout.dp), stage_elements)
    if zero == 3 and layout.dp > 1:
        total += (2 * w + g) * layer_elements
    if t.recompute_granularity == "full":
        total += (t.recompute_num_layers or 1) * layer_bytes(shape, _recomputed_layer(config, shape), False)
    return round(total)


def fused_loss_kept(shape: _Shape, vocab: int) -> float:
    """What --cross-entropy-loss-fusion keeps from a micro-batch's forward to its backward on the last stage
    (`model/fused_loss.py` computes the gradients in forward): the gradient of the hidden states (fp32, every
    token of the micro-batch), the output weight's gradient (fp32, this rank's vocabulary rows) and the labels; no
    logits. Under SP it keeps the hidden states gathered from the sequence shards, where the unfused output layer
    keeps the final norm's shard (counted in `_norm`) and gathers it again in backward."""
    gathered = shape.w * shape.h * (shape.tokens - shape.sharded_tokens)
    return (4 * shape.h + 8) * shape.tokens + gathered + 4 * vocab / shape.tp * shape.h


def fused_loss_buffer(shape: _Shape, vocab: int) -> float:
    """The fused loss's working memory, in place of the unfused [tokens x vocab / TP] logits in the compute type
    and in fp32: one chunk's logits (`chunk_tokens` tokens over this rank's vocabulary rows) in fp32, beside their
    matmul output or their gradient in the compute type when that is 16-bit, and then, in 16 bits, the chunk's
    weight-gradient product before it is added to the fp32 sum."""
    rows = vocab / shape.tp
    tokens = min(shape.tokens, chunk_tokens(round(rows)))
    narrow = shape.w if shape.w != 4 else 0
    return (4 + narrow) * tokens * rows + narrow * rows * shape.h
