"""Cutting the model into pipeline stages, and running this rank's chunks of it.

The model is cut into pp x chunks consecutive stages of whole layers; chunk c of pipeline
rank r is stage c x pp + r (under ZB-V: stage r, then stage 2 pp - 1 - r). The first stage also holds the embeddings; the last holds the
final norm, the output layer and the loss. This rank keeps the single-device `GPT` object
with every piece it does not hold set to None, so its parameters keep their single-device
names (initialization, checkpoints and gradient norms read names).

With tied embeddings the last stage keeps its own copy of the embedding matrix as its
output weight; the two copies start equal (same name, same initialization) and stay equal
because their gradients are summed over the embedding group (first and last stage) before
each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratron.config.schema import Config
from paratron.errors import ConfigError
from paratron.model.gpt import GPT
from paratron.parallel.pipeline.schedules import Schedule, build_schedule, stage_of
from paratron.parallel.sharding import set_partial_grad


def layer_counts(num_layers: int, stages: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers of each stage: `first` and `last` (when given) for the end stages, the rest shared
    evenly by the stages between. Raises ValueError when that cannot be done."""
    if stages == 1:
        return [num_layers]
    counts: list[int | None] = [None] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if rest < 0 or (not free and rest):
        raise ValueError(f"the first and last stage take {fixed} layers, not {num_layers}")
    if free and rest % len(free):
        what = f"{num_layers} layers" if not fixed else f"the {rest} layers left by the end stages"
        raise ValueError(f"{what} do not split evenly into {len(free)} stages")
    for i in free:
        counts[i] = rest // len(free)
    if min(c for c in counts if c is not None) < 1:
        raise ValueError(f"{num_layers} layers cut into {stages} stages leave a stage without layers")
    return [int(c) for c in counts]  # type: ignore[arg-type]


def stage_ranges(counts: list[int]) -> list[range]:
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(s, s + c) for s, c in zip(starts, counts)]


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline layout a config asks for, resolved and checked."""

    counts: list[int]
    """Layers of each model stage."""
    schedule: Schedule | None
    """Every pipeline rank's operations (None without pipeline parallelism)."""


def plan_pipeline(config: Config, dp: int) -> PipelinePlan:
    """Resolve the pipeline settings of `config` at data-parallel size `dp`; ConfigError names
    the setting to change."""
    p, m, t = config.parallel, config.model, config.training
    pp = p.pipeline_model_parallel_size
    per_chunk, virtual = p.num_layers_per_virtual_pipeline_stage, p.virtual_pipeline_model_parallel_size
    chunks = virtual or 1
    if per_chunk is not None:
        if per_chunk < 1 or m.num_layers % (pp * per_chunk):
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide --num-layers "
                              f"{m.num_layers} into --pipeline-model-parallel-size {pp} ranks; choose a divisor of "
                              f"{m.num_layers // pp if m.num_layers % pp == 0 else m.num_layers}")
        chunks = m.num_layers // (pp * per_chunk)
        if virtual is not None and virtual != chunks:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size {virtual} disagrees with "
                              f"--num-layers-per-virtual-pipeline-stage {per_chunk} ({chunks} chunks); give one of them")
    if chunks < 1:
        raise ConfigError(f"--virtual-pipeline-model-parallel-size {chunks}: must be at least 1")
    schedule = p.pipeline_schedule or ("interleaved" if chunks > 1 else "1f1b")
    if schedule == "zb-v" and pp > 1:
        if per_chunk is not None or virtual not in (None, 2):
            raise ConfigError("--pipeline-schedule zb-v places two chunks per rank itself; drop "
                              "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size")
        chunks = 2
    if chunks > 1 and pp == 1:
        raise ConfigError("virtual pipeline stages need --pipeline-model-parallel-size above 1")
    if chunks > 1 and schedule not in ("interleaved", "zb-v"):
        raise ConfigError(f"--pipeline-schedule {schedule} runs one chunk per rank; use --pipeline-schedule "
                          "interleaved with virtual pipeline stages, or drop them")
    if schedule == "interleaved" and chunks == 1 and pp > 1:
        raise ConfigError("--pipeline-schedule interleaved needs virtual stages; set "
                          "--num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size")
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if chunks > 1 and (first is not None or last is not None):
        raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with virtual pipeline "
                          "stages or zb-v; drop one")
    try:
        counts = layer_counts(m.num_layers, pp * chunks, first if pp > 1 else None, last if pp > 1 else None)
    except ValueError as exc:
        virtual = f" x {chunks} virtual stages" if chunks > 1 else ""
        raise ConfigError(f"--num-layers {m.num_layers} with --pipeline-model-parallel-size {pp}{virtual}: {exc}; "
                          "choose sizes that divide the layer count, or set --decoder-first-pipeline-num-layers / "
                          "--decoder-last-pipeline-num-layers") from None
    global_batch = t.global_batch_size or t.micro_batch_size * dp
    microbatches = global_batch // (t.micro_batch_size * dp)
    if pp == 1:
        return PipelinePlan(counts, None)
    try:
        return PipelinePlan(counts, build_schedule(schedule, pp, microbatches, chunks))
    except ValueError as exc:
        raise ConfigError(f"--global-batch-size {global_batch}: {exc}; change the batch sizes") from None


@dataclass
class StageLayout:
    """Which stages (and so which layers) this pipeline rank runs."""

    pp: int
    chunks: int
    rank: int
    ranges: list[range]
    """Layer numbers of every model stage."""
    v_shape: bool = False
    """Chunks placed as a V (ZB-V): rank r runs stages r and 2 pp - 1 - r."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, chunk: int) -> int:
        return stage_of(self.rank, chunk, self.pp, self.v_shape)

    def my_layers(self) -> set[int]:
        return {i for c in range(self.chunks) for i in self.ranges[self.stage(c)]}

    @property
    def holds_first(self) -> bool:
        return self.rank == 0

    @property
    def holds_last(self) -> bool:
        return self.stage(self.chunks - 1) == self.num_stages - 1


def keep_stage(model: GPT, layout: StageLayout, embedding_group=None) -> GPT:
    """Drop every piece of `model` (on the meta device) that this rank does not run; returns it.

    With tied embeddings and more than one rank, the embedding weight's gradient is marked to
    be summed over `embedding_group`, and the last stage's copy is marked as a duplicate so
    gradient norms count it once."""
    keep = layout.my_layers()
    for i in range(len(model.layers)):
        if i not in keep:
            model.layers[i] = None  # type: ignore[assignment]
    if not layout.holds_first:
        model.position_embedding = None
        if not (layout.holds_last and model.tied):
            model.embedding = None  # type: ignore[assignment]
    if not layout.holds_last:
        model.final_norm = None  # type: ignore[assignment]
        model.output = None  # type: ignore[assignment]
    if model.tied and (layout.holds_first != layout.holds_last):  # the two ends on different ranks
        weight = model.embedding.weight
        set_partial_grad(weight, embedding_group)
        if not layout.holds_first:
            weight.pipeline_duplicate = True  # type: ignore[attr-defined]
    return model


class StageRunner(nn.Module):
    """Runs one chunk of this rank's stages: the first stage starts from token ids, the last
    ends in logits; the others map hidden states to hidden states. (A module, so that wrappers
    hooked on forward, such as FSDP's, see each chunk run.)"""

    def __init__(self, model: GPT, layout: StageLayout) -> None:
        super().__init__()
        self.model, self.layout = model, layout

    def is_first(self, chunk: int) -> bool:
        return self.layout.stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.layout.stage(chunk) == self.layout.num_stages - 1

    def forward(self, chunk: int, x: torch.Tensor, seq_length: int) -> torch.Tensor:
        """`x` is token ids on the first stage and the previous stage's output elsewhere;
        `seq_length` is the whole sequence's (x may hold a sequence-parallel shard)."""
        model = self.model
        if self.is_first(chunk):
            x = model.embed(x)
        rotary = model.rotary_tables(seq_length, 0, x.device)
        x = model.run_layers(x, self.layout.ranges[self.layout.stage(chunk)], rotary)
        return model.head(x) if self.is_last(chunk) else x
