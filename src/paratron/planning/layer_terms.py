"""The layers each pipeline stage holds, by their kinds, and one layer's forward work summed from its kinds.

A layer is a residual sublayer of one kind (a --hybrid-layer-pattern's symbol) or a Transformer block, the pair
attention and MLP (or mixture of experts); `model.transformer.layer_kinds` gives each layer's kinds without building
the model. Each kind declares its own terms against one rank's share of a micro-batch (`model.layer_kind`:
`activation_bytes`, `forward_work`), so the planner prices any stack of kinds by summing them: `activations` adds a
norm per sublayer to their saved bytes, `operations` the communication per sublayer to their work. Layers of the
same kinds are priced once (a stage holds many alike, and the search prices thousands of layouts).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratron.config.schema import Config, ModelConfig
from paratron.model.layer_kind import ContextParallel, LayerKind, MicroBatchShare
from paratron.model.transformer import layer_kinds
from paratron.training.flops import attended_keys

LayerKinds = tuple[type[LayerKind], ...]
"""One layer's kinds, in the order its sublayers run."""

WIDTHS = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each --precision's compute type."""

StageKinds = tuple[tuple[LayerKinds, int], ...]
"""A stage's layers: each distinct layer (its kinds) and how many of them, in `by_symbols` order."""


def by_symbols(kinds: LayerKinds) -> str:
    """The order a stage's distinct layers are summed in: by their kinds' pattern symbols (a block `*-` before an
    MoE block `*E`), so that a sum does not depend on which layer comes first."""
    return "".join(kind.symbol for kind in kinds)


class _ModelLayers:
    """One model's layers by their kinds, and what has been worked out from them (per stage split, per share)."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model
        self.kinds = tuple(layer_kinds(model))
        self.distinct = tuple(sorted(set(self.kinds), key=by_symbols))
        self.stages: dict[tuple[int, ...], tuple[StageKinds, ...]] = {}
        self.works: dict[MicroBatchShare, dict[LayerKinds, LayerWork]] = {}


_MODELS: dict[int, _ModelLayers] = {}
"""By the model's identity: a search asks thousands of times about one model, and hashing a ModelConfig (every
field) would cost more than the answers."""


def _layers_of(model: ModelConfig) -> _ModelLayers:
    found = _MODELS.get(id(model))
    if found is None or found.model is not model:
        if len(_MODELS) >= 256:
            _MODELS.clear()
        found = _MODELS[id(model)] = _ModelLayers(model)
    return found


def model_layer_kinds(model: ModelConfig) -> tuple[LayerKinds, ...]:
    """Each layer's kinds, by layer number."""
    return _layers_of(model).kinds


def distinct_layers(model: ModelConfig) -> tuple[LayerKinds, ...]:
    """The model's different layers, in `by_symbols` order."""
    return _layers_of(model).distinct


def stage_kinds(model: ModelConfig, counts: tuple[int, ...]) -> tuple[StageKinds, ...]:
    """Per model stage (`counts`: layers of each), its distinct layers and how many of each."""
    layers = _layers_of(model)
    if counts not in layers.stages:
        out, start = [], 0
        for count in counts:
            held: dict[LayerKinds, int] = {}
            for layer in layers.kinds[start : start + count]:
                held[layer] = held.get(layer, 0) + 1
            out.append(tuple(sorted(held.items(), key=lambda item: by_symbols(item[0]))))
            start += count
        layers.stages[counts] = tuple(out)
    return layers.stages[counts]


def computed_keys(model: ModelConfig, seq_length: int) -> float:
    """Keys per query the attention kernels compute: of the attended keys, causal masking skips
    the upper triangle (a query at position q sees min(q + 1, keys) of them)."""
    keys = attended_keys(model, seq_length)
    return keys * (1 - keys / (2 * seq_length)) + 0.5


def work_share(config: Config, tp: int, cp: int, micro_batch: int) -> MicroBatchShare:
    """One rank's share of a micro-batch for pricing work: b x s / CP tokens, matrices / TP (the kernel facts, which
    only saved activations depend on, left at their defaults)."""
    m, seq = config.model, config.data.seq_length
    return MicroBatchShare(
        tokens=micro_batch * seq / cp,
        seq=seq // cp,
        keys=attended_keys(m, seq),
        computed_keys=computed_keys(m, seq),
        width=WIDTHS[config.training.precision],
        tp=tp,
        expert_tp=config.parallel.expert_tensor_parallel_size or tp,
        sp=config.parallel.sequence_parallel,
        cp=cp,
        cp_gather=config.parallel.cp_comm_type == "all_gather",
    )


@dataclass(frozen=True)
class LayerWork:
    """Forward FLOPs of one layer for one micro-batch on one rank, and the sublayers its communication follows."""

    linear: float
    """Matmuls with weights (attention projections, MLP or experts): backward = 2x, half of it W."""
    scores: float
    """Attention scores and their product with values, over the keys each query computes."""
    sublayers: int
    """Residual sublayers: each reduces its output over TP (and gathers its input under sequence parallelism)."""
    attentions: int
    """Sublayers whose keys and values pass around the context-parallel ring."""
    all_to_alls: int
    """Sublayers whose tokens travel to their experts and back through all-to-alls."""


def layer_works(model: ModelConfig, share: MicroBatchShare) -> dict[LayerKinds, LayerWork]:
    """`layer_work` of each of the model's different layers (the search prices many layouts of one share)."""
    layers = _layers_of(model)
    if share not in layers.works:
        layers.works[share] = {kinds: layer_work(model, kinds, share) for kinds in layers.distinct}
    return layers.works[share]


def layer_work(model: ModelConfig, kinds: LayerKinds, share: MicroBatchShare) -> LayerWork:
    """A layer's forward work: its kinds' `forward_work`, summed."""
    works = [kind.forward_work(model, share) for kind in kinds]
    return LayerWork(
        linear=sum(work.linear for work in works),
        scores=sum(work.scores for work in works),
        sublayers=len(kinds),
        attentions=sum(kind.context_parallel is ContextParallel.ATTENTION_CORE for kind in kinds),
        all_to_alls=sum(work.all_to_all for work in works),
    )
