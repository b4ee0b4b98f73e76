"""Each rank's memory under a layout, fast enough to price thousands of layouts.

`paratron train --dry-run` builds every rank role for real (`planning/dry_run.py`); the planner
cannot afford that for each of thousands of candidates, so `predict_memory` builds the model
once per tensor- x expert-parallel size, on the meta device through the real `parallelize`
(one layer of each kind: each distinct Transformer block, or each symbol of a --hybrid-layer-pattern once;
the embeddings and the head), counts what one rank holds of each part,
and prices the training state of each pipeline rank from those counts with ZeRO's arithmetic:

    stage 0    weights w P, gradients g P, masters 4 P (none in fp32), Adam 8 P
    stage 1    masters and optimizer state / N (N: the ranks the gradients are reduced over)
    stage 2    gradients / N too
    stage 3    fp32 weight shards (the masters) and gradients / N, weights gathered per layer

(P: elements this rank trains, w: bytes of the compute type, g: of the gradients, 4 or 2 with
--grad-reduce-in-bf16 (FSDP2's gradient shards stay fp32 at stage 3); frozen weights have weights only).
A vision-language model's encoder and projector are counted on the first pipeline stage, as
`keep_stage` places them (the encoder's carried layers and a frozen encoder: weights only).
tests/unit/test_dry_run.py checks it against the dry run's built shards. Activations and
transient buffers come from `planning/activations.py`, as in the dry run.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from paratron.config.layout import Layout, resolve_layout
from paratron.config.schema import Config, ModelConfig, ParallelConfig
from paratron.distributed.fake import fake_world
from paratron.distributed.topology import ParallelDims, Topology
from paratron.model.gpt import GPT
from paratron.parallel.parallelize import parallelize
from paratron.parallel.sharding import is_expert
from paratron.planning.activations import (
    WIDTHS,
    Kernels,
    activation_peaks,
    buffer_bytes,
    grad_width,
    rank_model_stages,
)
from paratron.planning.layer_terms import LayerKinds, StageKinds, model_layer_kinds, stage_kinds

CATEGORIES = ("parameters", "gradients", "master", "optimizer_state", "activations", "buffers")

META = torch.device("meta")


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of a role holds at its peak (the first step's backward)."""

    stage: int
    """The pipeline rank: ranks of one stage hold the same shapes, whatever their other coordinates."""
    ranks: int
    """How many ranks of the world play this role."""
    parameters: int
    gradients: int
    master: int
    optimizer_state: int
    activations: int
    buffers: int

    @property
    def state(self) -> int:
        return self.parameters + self.gradients + self.master + self.optimizer_state

    @property
    def measured(self) -> int:
        """What `--log-memory` counts: the training state and the activations kept for backward."""
        return self.state + self.activations

    @property
    def total(self) -> int:
        return self.measured + self.buffers


@dataclass(frozen=True)
class Parts:
    """Elements of one part of the model on one rank: trained (dense, experts) and frozen."""

    dense: int = 0
    experts: int = 0
    frozen: int = 0

    def __add__(self, other: Parts) -> Parts:
        return Parts(self.dense + other.dense, self.experts + other.experts, self.frozen + other.frozen)

    def __mul__(self, times: int) -> Parts:
        return Parts(self.dense * times, self.experts * times, self.frozen * times)

    @property
    def trained(self) -> int:
        return self.dense + self.experts


@dataclass(frozen=True)
class LocalParameters:
    """What one rank holds of each part of the model at a tensor- and expert-parallel size."""

    layers: dict[LayerKinds, Parts]
    """Each distinct layer's (by its kinds: a Transformer block, a pattern's sublayer)."""
    embedding: Parts  # token and learned position embeddings
    head: Parts  # final norm, and the output layer when it is not the embedding
    output_copy: Parts  # the tied output layer a last pipeline stage holds of its own
    vision: Parts = Parts()  # a vision-language model's encoder and projector (first stage)


def _counting_model(model: ModelConfig) -> ModelConfig:
    """The model with one layer of each kind it has (and its whole vision encoder: its layers are few): a pattern's
    symbols once each, or one Transformer block of each kind."""
    if model.layer_pattern is not None:
        return replace(model, hybrid_layer_pattern="".join(dict.fromkeys(model.layer_pattern.symbols)))
    kinds = sorted(set(model.moe_layer_pattern))
    if len(kinds) == 2:
        return replace(model, num_layers=2, moe_layer_freq="[0,1]")
    return replace(model, num_layers=1, moe_layer_freq="1")


@functools.lru_cache(maxsize=256)
def local_parameters(model: ModelConfig, tp: int, ep: int, etp: int | None) -> LocalParameters:
    """Counted on the meta device through `parallelize` (cached per model and sizes)."""
    counting = Config(model=_counting_model(model))
    counting = replace(
        counting,
        parallel=ParallelConfig(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        ),
    )
    world = math.lcm(tp, (etp or tp) * ep)  # (the smallest stage the experts' grid folds over)
    with fake_world(world, 0):
        topology = Topology(ParallelDims(world, tp=tp, ep=ep, etp=etp), 0)
        topology.create_groups()
        with META:
            built = GPT(counting.model)
        parallel = parallelize(built, counting, topology, META, resolve_layout(counting, world))
        parts: dict[str, Parts] = {}
        for name, param in parallel.module.named_parameters():
            key = name.split(".")[0] if not name.startswith("layers.") else ".".join(name.split(".")[:2])
            one = (
                Parts(frozen=param.numel())
                if not param.requires_grad
                else (Parts(experts=param.numel()) if is_expert(param) else Parts(dense=param.numel()))
            )
            parts[key] = parts.get(key, Parts()) + one
    layers = {kinds: parts[f"layers.{i}"] for i, kinds in enumerate(model_layer_kinds(counting.model))}
    tied = not model.untie_embeddings_and_output_weights
    embedding = parts["embedding"] + parts.get("position_embedding", Parts())
    head = parts["final_norm"] + (Parts() if tied else parts["output"])
    return LocalParameters(
        layers=layers,
        embedding=embedding,
        head=head,
        output_copy=parts["embedding"] if tied else Parts(),
        vision=parts.get("vision", Parts()),
    )


def _rank_parts(config: Config, layout: Layout, local: LocalParameters) -> list[tuple[Parts, int]]:
    """Per pipeline rank, the elements it holds and its largest layer's (each kind of model stage counted once)."""
    last = layout.pp * layout.pipeline.chunks - 1
    counted: dict[tuple[StageKinds, bool, bool], tuple[Parts, int]] = {}
    stages = []
    for stage, held in enumerate(stage_kinds(config.model, tuple(layout.pipeline.counts))):
        kind = (held, stage == 0, stage == last)
        if kind not in counted:
            counted[kind] = _stage_parts(layout, local, *kind)
        stages.append(counted[kind])
    held_stages = [[0] if layout.pp == 1 else rank_model_stages(layout, r) for r in range(layout.pp)]
    out = []
    for mine in held_stages:
        total, largest = Parts(), 0
        for stage in mine:
            total, largest = total + stages[stage][0], max(largest, stages[stage][1])
        out.append((total, largest))
    return out


def _stage_parts(
    layout: Layout, local: LocalParameters, held: StageKinds, first: bool, last: bool
) -> tuple[Parts, int]:
    """Elements a model stage holding `held` layers holds, and its largest layer's."""
    total, largest = Parts(), 0
    for kinds, count in held:
        layer = local.layers[kinds]
        total, largest = total + layer * count, max(largest, layer.trained + layer.frozen)
    if first:
        total = total + local.embedding + local.vision
    if last:
        total = total + local.head + (local.output_copy if layout.pp > 1 else Parts())
    return total, largest


def _state(config: Config, parts: Parts, dp: int, edp: int) -> dict[str, int]:
    """ZeRO's arithmetic (module docstring) over the dense gradients' group (`dp` ranks, with
    context parallelism x CP) and the experts' (`edp`)."""
    p, w, g = config.parallel, WIDTHS[config.training.precision], grad_width(config)
    zero, fp32 = p.zero_stage, config.training.precision == "fp32"
    moments = 2 if config.optimizer.optimizer == "adam" else (1 if config.optimizer.sgd_momentum else 0)
    report = dict.fromkeys(("parameters", "gradients", "master", "optimizer_state"), 0.0)
    for elements, size in ((parts.dense, dp), (parts.experts, edp)):
        if not elements:
            continue
        if zero == 3 and size > 1:
            shard = -(-elements // size)
            report["parameters"] += 4 * shard
            report["gradients"] += 4 * shard
            report["optimizer_state"] += 4 * moments * shard
            continue
        padded = -(-elements // size) * size if zero else elements
        shard = padded // size if zero else padded
        report["parameters"] += w * padded
        report["gradients"] += g * (shard if zero == 2 and size > 1 else padded)
        report["master"] += 0 if fp32 else 4 * shard
        report["optimizer_state"] += 4 * moments * shard
    frozen_width = 4 if zero == 3 and dp > 1 else w
    report["parameters"] += frozen_width * parts.frozen / (dp if zero == 3 and dp > 1 else 1)
    return {k: round(v) for k, v in report.items()}


def predict_memory(
    config: Config,
    world_size: int,
    kernels: Kernels,
    layout: Layout | None = None,
    activations: list[int] | None = None,
) -> list[RankMemory]:
    """Per pipeline rank, the memory of a rank of `config`'s layout on `world_size` ranks (the
    vocabulary must be set: `planning.dry_run.with_vocabulary`). `activations`: each rank's
    `activation_peaks`, where known (they do not change with the ZeRO stage)."""
    layout = layout or resolve_layout(config, world_size)
    p = config.parallel
    local = local_parameters(config.model, layout.tp, p.expert_model_parallel_size, p.expert_tensor_parallel_size)
    dp = layout.dp * layout.cp
    edp = layout.edp
    roles = []
    peaks = activations if activations is not None else activation_peaks(config, layout, kernels)
    for pp_rank, (parts, largest) in enumerate(_rank_parts(config, layout, local)):
        roles.append(
            RankMemory(
                stage=pp_rank,
                ranks=world_size // layout.pp,
                activations=peaks[pp_rank],
                buffers=buffer_bytes(config, layout, pp_rank, kernels, parts.trained, largest),
                **_state(config, parts, dp, edp),
            )
        )
    return roles
