"""The shape of a run, worked out once with no dependencies: the size of every parallel axis (a
`config.dims.ParallelDims`, the one place data-parallel sizes are computed), the global batch and the
micro-batches each rank runs per step (`BatchPlan`, one data-parallel rank's view), and the pipeline
plan (layers per stage, model chunks per rank, the schedule's name).

`resolve_layout(config, world_size)` is called by validation, which returns its result; the
commands hand that `Layout` to the workers' entry (`training.run.run_training`, `run_evaluation`,
`open_engine`), which pass it to the topology, the data loader, `parallelize` and the training loop
instead of working the numbers out again; a launcher hands it, with the settings, to the workers it starts
(`commands.launching`). Errors are ConfigErrors that name the setting to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from paratron.config.dims import ParallelDims
from paratron.config.fields import flag
from paratron.config.schema import Config
from paratron.errors import ConfigError


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline layout a config asks for, resolved and checked."""

    counts: tuple[int, ...]
    """Layers of each model stage (pp x chunks of them)."""
    chunks: int
    """Model chunks (virtual stages) per pipeline rank."""
    schedule: str | None
    """The schedule's name (None without pipeline parallelism)."""

    @cached_property
    def ranges(self) -> list[range]:
        """Layer numbers of every model stage (read only)."""
        return stage_ranges(list(self.counts))


@dataclass(frozen=True)
class BatchPlan:
    """One data-parallel rank's view of a step's batch: which samples it reads, in how many micro-batches.
    Made by `Layout.batches` (a batch-size ramp gives the step's global batch)."""

    global_batch_size: int
    micro_batch_size: int
    dp_size: int
    dp_rank: int

    @property
    def num_micro_batches(self) -> int:
        """A global batch is consumed as this many steps of micro_batch_size x dp samples."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def sample_indices(self, consumed_samples: int) -> list[list[int]]:
        """Global sample indices of this rank's micro-batches in the batch starting at `consumed_samples`."""
        step = self.micro_batch_size * self.dp_size
        out = []
        for m in range(self.num_micro_batches):
            first = consumed_samples + m * step + self.dp_rank * self.micro_batch_size
            out.append(list(range(first, first + self.micro_batch_size)))
        return out


@dataclass(frozen=True)
class Layout:
    """How a run is laid out: the sizes of every parallel axis (`dims`), the batches and the pipeline."""

    dims: ParallelDims
    micro_batch_size: int
    global_batch_size: int
    pipeline: PipelinePlan

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def etp(self) -> int:
        """The experts' tensor-parallel size (the tensor-parallel size unless set)."""
        return self.dims.expert_tp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def edp(self) -> int:
        return self.dims.edp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per step."""
        return self.batches(0).num_micro_batches

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON), which `from_dict` reads back: how a launcher hands the layout to its workers."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        pipeline = data["pipeline"]
        return cls(
            ParallelDims(**data["dims"]),
            data["micro_batch_size"],
            data["global_batch_size"],
            PipelinePlan(tuple(pipeline["counts"]), pipeline["chunks"], pipeline["schedule"]),
        )

    def batches(self, dp_rank: int, global_batch_size: int | None = None) -> BatchPlan:
        """Data-parallel rank `dp_rank`'s view of a step of `global_batch_size` samples (the run's global
        batch unless a batch-size ramp says otherwise)."""
        size = self.global_batch_size if global_batch_size is None else global_batch_size
        return BatchPlan(size, self.micro_batch_size, self.dp, dp_rank)


def layer_counts(
    num_layers: int,
    stages: int,
    first: int | None = None,
    last: int | None = None,
    *,
    embedding: bool = False,
    loss: bool = False,
) -> list[int]:
    """Layers of each model stage: `first` and `last` (when given) for the end stages, the rest shared
    evenly by the stages between. With `embedding` / `loss` (Megatron-LM's account-for-embedding/loss
    split) the input embedding and the output layer with the loss each count as one layer of the first
    and last stage: the layers plus those are cut evenly and the end stages run one layer fewer, perhaps
    none. Raises ValueError when that cannot be done."""
    if embedding or loss:
        if first is not None or last is not None:
            raise ValueError("the end stages' layer counts cannot be given when the embedding or loss is counted")
        return _counted_ends(num_layers, stages, embedding, loss)
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


def _counted_ends(num_layers: int, stages: int, embedding: bool, loss: bool) -> list[int]:
    """Megatron-LM's rule: (layers + embedding + loss) must divide evenly into the stages (pipeline
    ranks x virtual stages); the first stage gives one share to the embedding, the last to the loss."""
    units = num_layers + int(embedding) + int(loss)
    if units % stages:
        counted = " + ".join(["the embedding"] * embedding + ["the loss"] * loss)
        raise ValueError(f"{num_layers} layers + {counted} ({units}) do not split evenly into {stages} stages")
    counts = [units // stages] * stages
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    return counts


def stage_ranges(counts: list[int]) -> list[range]:
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def check_schedule(name: str, pp: int, microbatches: int, chunks: int) -> None:
    """The shape rules of the pipeline schedules; ValueError names the broken one."""
    if pp < 1 or microbatches < 1 or chunks < 1:
        raise ValueError("pipeline size, micro-batches and chunks must be positive")
    if name == "zb-v":
        if chunks not in (1, 2):
            raise ValueError("the zb-v schedule runs exactly two chunks per rank")
        return
    if name != "interleaved" and chunks != 1:
        raise ValueError(f"the {name} schedule runs one model chunk per rank; virtual stages need 'interleaved'")
    if name == "interleaved" and microbatches % pp:
        raise ValueError(
            f"the interleaved schedule needs a number of micro-batches ({microbatches}) "
            f"divisible by the pipeline size ({pp})"
        )


def resolve_layout(config: Config, world_size: int) -> Layout:
    """The layout of `config` on `world_size` ranks; ConfigError names the setting to change."""
    p, t = config.parallel, config.training
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if world_size % (tp * cp * pp):
        context = f"{flag.context_parallel_size} {cp} x " if cp > 1 else ""
        raise ConfigError(
            f"world size {world_size} is not divisible by {flag.tensor_model_parallel_size} {tp} x {context}"
            f"{flag.pipeline_model_parallel_size} {pp}; use a multiple of {tp * cp * pp} processes"
        )
    dense = ParallelDims(world_size, tp=tp, pp=pp, cp=cp)  # (the experts' grid is checked last, as validation does)
    if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dense.dp):
        raise ConfigError(
            f"{flag.global_batch_size} {t.global_batch_size} is not divisible by "
            f"{flag.micro_batch_size} {t.micro_batch_size} x data-parallel size {dense.dp}; use a multiple of "
            f"{t.micro_batch_size * dense.dp}"
        )
    global_batch = t.global_batch_size or t.micro_batch_size * dense.dp
    batches = Layout(dense, t.micro_batch_size, global_batch, PipelinePlan((), 1, None))  # (its plan is next)
    plan = _plan_pipeline(config, global_batch, batches.num_micro_batches)
    return Layout(_dims(config, world_size), t.micro_batch_size, global_batch, plan)


def _dims(config: Config, world_size: int) -> ParallelDims:
    """The sizes of every axis; an expert grid that does not fold over the ranks of a pipeline stage is
    the ConfigError validation gives for it (`check_expert_grid`)."""
    p = config.parallel
    try:
        return ParallelDims.from_config(world_size, p)
    except ValueError:
        stage = world_size // p.pipeline_model_parallel_size
        check_expert_grid(config, p.tensor_model_parallel_size, p.context_parallel_size, stage)
        raise


def check_expert_grid(config: Config, tp: int, cp: int, stage: int) -> None:
    """The experts' grid (expert-TP x EP x expert-DP) folded over the `stage` = TP x CP x DP ranks of each
    pipeline stage, as Megatron-Core lays it; a dense model asks for no expert parallelism."""
    m, p = config.model, config.parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    dp = stage // (tp * cp)
    if ep < 1:
        raise ConfigError(f"{flag.expert_model_parallel_size} {ep}: must be at least 1")
    if etp is not None and stage % etp:
        raise ConfigError(
            f"{flag.expert_tensor_parallel_size} {etp} does not divide the {stage} ranks of a pipeline stage "
            f"(TP {tp} x CP {cp} x DP {dp}); choose a divisor"
        )
    if not m.num_experts:  # (Megatron-LM accepts an expert tensor-parallel size for a dense model; it changes nothing)
        if ep > 1:
            raise ConfigError(
                f"{flag.expert_model_parallel_size} needs a mixture-of-experts model: add {flag.num_experts}"
            )
        return
    if m.num_experts % ep:
        raise ConfigError(
            f"{flag.num_experts} {m.num_experts} is not divisible by {flag.expert_model_parallel_size} {ep}; "
            "choose an expert-parallel size that divides the number of experts"
        )
    expert_tp = tp if etp is None else etp
    if stage % (ep * expert_tp):
        raise ConfigError(
            f"{flag.expert_model_parallel_size} {ep} x expert tensor-parallel size {expert_tp} = {ep * expert_tp} "
            f"does not divide the {stage} ranks of a pipeline stage (TP {tp} x CP {cp} x DP "
            f"{dp}), over which the experts' grid is laid; choose sizes whose product divides it"
        )


def _chunks(config: Config) -> tuple[int, str]:
    """Model chunks per pipeline rank and the schedule's name, checked against each other."""
    p, m = config.parallel, config.model
    pp = p.pipeline_model_parallel_size
    per_chunk, virtual = p.num_layers_per_virtual_pipeline_stage, p.virtual_pipeline_model_parallel_size
    chunks = virtual or 1
    if per_chunk is not None:
        # the embedding and the loss count as layers here too when they are counted in the split
        ends = int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split)
        units = m.num_layers + ends
        counted = f" (+ {units - m.num_layers} counted for the embedding / loss)" if units > m.num_layers else ""
        if per_chunk < 1 or units % (pp * per_chunk):
            raise ConfigError(
                f"{flag.num_layers_per_virtual_pipeline_stage} {per_chunk} does not divide "
                f"{flag.num_layers} {m.num_layers}{counted} into {flag.pipeline_model_parallel_size} {pp} ranks; "
                f"choose a divisor of {units // pp if units % pp == 0 else units}"
            )
        chunks = units // (pp * per_chunk)
        if virtual is not None and virtual != chunks:
            raise ConfigError(
                f"{flag.virtual_pipeline_model_parallel_size} {virtual} disagrees with "
                f"{flag.num_layers_per_virtual_pipeline_stage} {per_chunk} ({chunks} chunks); "
                "give one of them"
            )
    if chunks < 1:
        raise ConfigError(f"{flag.virtual_pipeline_model_parallel_size} {chunks}: must be at least 1")
    schedule = p.pipeline_schedule or ("interleaved" if chunks > 1 else "1f1b")
    if schedule == "zb-v" and pp > 1:
        if per_chunk is not None or virtual not in (None, 2):
            raise ConfigError(
                f"{flag.pipeline_schedule} zb-v places two chunks per rank itself; drop "
                f"{flag.num_layers_per_virtual_pipeline_stage} / {flag.virtual_pipeline_model_parallel_size}"
            )
        chunks = 2
    if chunks > 1 and pp == 1:
        raise ConfigError(f"virtual pipeline stages need {flag.pipeline_model_parallel_size} above 1")
    if chunks > 1 and schedule not in ("interleaved", "zb-v"):
        raise ConfigError(
            f"{flag.pipeline_schedule} {schedule} runs one chunk per rank; use {flag.pipeline_schedule} "
            "interleaved with virtual pipeline stages, or drop them"
        )
    if schedule == "interleaved" and chunks == 1 and pp > 1:
        raise ConfigError(
            f"{flag.pipeline_schedule} interleaved needs virtual stages; set "
            f"{flag.num_layers_per_virtual_pipeline_stage} or {flag.virtual_pipeline_model_parallel_size}"
        )
    return chunks, schedule


def _plan_pipeline(config: Config, global_batch: int, microbatches: int) -> PipelinePlan:
    """Resolve the pipeline settings of `config` for `microbatches` micro-batches per step."""
    p, m = config.parallel, config.model
    pp = p.pipeline_model_parallel_size
    chunks, schedule = _chunks(config)
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    embedding, loss = p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split
    if (embedding or loss) and (first is not None or last is not None):
        raise ConfigError(
            f"{flag.account_for_embedding_in_pipeline_split} / {flag.account_for_loss_in_pipeline_split} cannot be "
            f"combined with {flag.decoder_first_pipeline_num_layers} / {flag.decoder_last_pipeline_num_layers} "
            "(Megatron-LM refuses it too); drop one"
        )
    if chunks > 1 and (first is not None or last is not None):
        raise ConfigError(
            f"{flag.decoder_first_pipeline_num_layers} / {flag.decoder_last_pipeline_num_layers} "
            "cannot be combined with virtual pipeline stages or zb-v; drop one"
        )
    for given, name in ((first, flag.decoder_first_pipeline_num_layers), (last, flag.decoder_last_pipeline_num_layers)):
        if pp == 1 and given is not None and given != m.num_layers:
            raise ConfigError(
                f"{name} {given} with {flag.pipeline_model_parallel_size} 1: the only stage holds all "
                f"{m.num_layers} layers; set it to {m.num_layers} or drop it (Megatron-LM refuses it too)"
            )
    ends = (first, last) if pp > 1 else (None, None)
    stages = m.layer_pattern.stage_sizes if m.layer_pattern is not None else ()
    try:
        if len(stages) > 1:  # (a pattern's '|' places each stage's layers; `pattern_checks` matched them to the run)
            counts = list(stages)
        else:
            counts = layer_counts(m.num_layers, pp * chunks, *ends, embedding=embedding, loss=loss)
    except ValueError as exc:
        virtual = f" x {chunks} virtual stages" if chunks > 1 else ""
        fix = (
            f"or drop {flag.account_for_embedding_in_pipeline_split} / {flag.account_for_loss_in_pipeline_split}"
            if embedding or loss
            else f"or set {flag.decoder_first_pipeline_num_layers} / {flag.decoder_last_pipeline_num_layers}"
        )
        raise ConfigError(
            f"{flag.num_layers} {m.num_layers} with {flag.pipeline_model_parallel_size} {pp}{virtual}: "
            f"{exc}; choose sizes that divide the layer count, {fix}"
        ) from None
    if pp == 1:
        return PipelinePlan(tuple(counts), chunks, None)
    try:
        check_schedule(schedule, pp, microbatches, chunks)
    except ValueError as exc:
        raise ConfigError(f"{flag.global_batch_size} {global_batch}: {exc}; change the batch sizes") from None
    return PipelinePlan(tuple(counts), chunks, schedule)
