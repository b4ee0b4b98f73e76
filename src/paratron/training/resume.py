"""How a run continues: from scratch, from a checkpoint's weights, where a checkpoint left off (a
resume, a restart after a fault, a Megatron-LM checkpoint), or back at the newest checkpoint after a
non-finite loss (--on-nan rollback).

`plan_resume` decides it once, from the config and what is on disk, as a `ResumePlan`; the run
and the loop read the plan, and `Restorer.restore` applies it to this rank's model, optimizer and
counters.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratron.checkpoint.load import load_model_weights, load_training_state, weight_catalog
from paratron.checkpoint.model_of import paratron_checkpoint
from paratron.checkpoint.native import load_converted_optimizer
from paratron.checkpoint.optimizer_state import load_optimizer
from paratron.checkpoint.verify import CheckpointInfo, read_checkpoint
from paratron.config.schema import CheckpointConfig, Config
from paratron.distributed import rng
from paratron.distributed.launch import restart_count
from paratron.distributed.topology import Axis, Topology
from paratron.errors import CheckpointError
from paratron.optim.lr_schedule import LRSchedule
from paratron.optim.mixed_precision import Precision
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.model import ParallelModel


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    lr_samples: int = 0
    """Samples the applied steps trained (a skipped step's count not): where the learning-rate
    schedule stands (Megatron-LM's `OptimizerParamScheduler.num_steps`)."""
    losses: list[float] = field(default_factory=list)
    """Logged train loss of each log interval."""
    val_losses: list[float] = field(default_factory=list)


class Start(enum.Enum):
    """Where a run's training starts."""

    FRESH = "fresh"
    """From the seed's weights, step 0."""
    WEIGHTS = "weights"
    """From a checkpoint's weights only (--finetune, or a converted model), step 0."""
    RESUMED = "resumed"
    """Where a paratron checkpoint (--load) left off: weights, counters, generators, optimizer state."""
    RESTARTED = "restarted"
    """As RESUMED, from the newest checkpoint in --save after the job restarted (--max-restarts)."""
    MEGATRON = "megatron"
    """Where a Megatron-LM checkpoint left off: its weights, step and converted optimizer state."""
    ROLLBACK = "rollback"
    """Back at the newest checkpoint in --save after a non-finite loss (--on-nan rollback)."""


CONTINUING = (Start.RESUMED, Start.RESTARTED, Start.MEGATRON, Start.ROLLBACK)


@dataclass(frozen=True)
class ResumePlan:
    """How training starts, and from which checkpoint (None for FRESH, and for a ROLLBACK that
    found no checkpoint to go back to)."""

    start: Start
    checkpoint: CheckpointInfo | None = None

    @property
    def continuing(self) -> bool:
        """Whether the run goes on from the checkpoint's step rather than from step 0."""
        return self.start in CONTINUING and self.checkpoint is not None

    def initial_state(self) -> TrainState:
        """The counters training starts from."""
        if self.continuing and self.checkpoint is not None:
            return TrainState(self.checkpoint.iteration, self.checkpoint.consumed_samples)
        return TrainState()

    @classmethod
    def decide(
        cls, c: CheckpointConfig, checkpoint: CheckpointInfo | None, source: Path | None, restarted: bool
    ) -> ResumePlan:
        """The plan for `checkpoint`, read from `source` (a restart's --save, --load, or the paratron
        checkpoint a Megatron-LM --load was converted into)."""
        if checkpoint is None:
            return cls(Start.FRESH)
        if restarted:
            return cls(Start.RESTARTED, checkpoint)
        if c.finetune or checkpoint.weights_only:
            return cls(Start.WEIGHTS, checkpoint)
        converted = c.load is not None and source != Path(c.load).expanduser()
        return cls(Start.MEGATRON if converted else Start.RESUMED, checkpoint)


def restarted_from(c: CheckpointConfig) -> Path | None:
    """After a restart (--max-restarts), the save directory when it holds a checkpoint of this run:
    the job goes on from its newest intact one, not from --load again."""
    if restart_count() == 0 or c.save is None:
        return None
    try:
        read_checkpoint(Path(c.save), verify=False)
    except CheckpointError:  # (none yet: the run died before its first save)
        return None
    return Path(c.save)


def plan_resume(config: Config, cache: Path, local_rank: int, say: Callable[[str], None]) -> ResumePlan:
    """Decide how this run starts: after a restart from --save, else from --load (converted into
    the paratron format under `cache` when it is a Megatron-LM or Hugging Face one), else fresh."""
    c = config.checkpoint
    restarted = restarted_from(c)
    source = restarted or (
        paratron_checkpoint(Path(c.load).expanduser(), cache, c.finetune, local_rank, say) if c.load else None
    )
    checkpoint = read_checkpoint(source) if source is not None else None
    return ResumePlan.decide(c, checkpoint, source, restarted is not None)


def rollback_plan(save: Path) -> ResumePlan:
    """--on-nan rollback: back to the newest intact checkpoint in `save` (none: the plan has no
    checkpoint and the run stops)."""
    try:
        checkpoint = read_checkpoint(save)
    except CheckpointError:
        checkpoint = None
    return ResumePlan(Start.ROLLBACK, checkpoint)


class Restorer:
    """Saves and restores what this rank needs beyond a checkpoint's weights to continue exactly:
    counters, random generators, loss scaler, optimizer state and learning-rate schedule."""

    def __init__(
        self,
        config: Config,
        model: ParallelModel,
        optimizer: TrainingOptimizer,
        topology: Topology,
        precision: Precision,
        info: Callable[[str], None],
    ) -> None:
        self.config, self.model, self.optimizer = config, model, optimizer
        self.topology, self.precision, self.info = topology, precision, info

    def restore(self, plan: ResumePlan, state: TrainState, schedule: LRSchedule, batch: int) -> LRSchedule:
        """Apply `plan` to the model, the optimizer and `state` (the weights of a plan other than
        ROLLBACK are loaded by the run, before the optimizer takes its masters); returns the
        learning-rate schedule to go on with. `batch`: the global batch size."""
        c, checkpoint = self.config.checkpoint, plan.checkpoint
        if not plan.continuing or checkpoint is None:
            return schedule
        if plan.start is Start.MEGATRON:  # (converted: its step and optimizer state, no RNG state)
            if c.no_load_optim or not load_converted_optimizer(checkpoint.path, self.optimizer, self.model.module):
                self.info(f"{c.load}: Megatron-LM optimizer state not converted; the optimizer starts fresh")
            else:  # (Megatron-LM loads its scheduler with the optimizer: the schedule goes on from the samples trained)
                state.lr_samples = checkpoint.consumed_samples
            return schedule
        rollback = plan.start is Start.ROLLBACK
        if rollback:
            load_model_weights(checkpoint, self.model.module, whole=self.topology.size(Axis.PP) == 1)
        state.iteration, state.consumed_samples = checkpoint.iteration, checkpoint.consumed_samples
        state_of_rank, own = load_training_state(checkpoint, self.topology)
        self.restore_rank_state(state_of_rank, state, own)
        if "lr_schedule_samples" not in state_of_rank:  # (saved before the schedule counted samples)
            skipped = state.skipped_iterations * batch
            state.lr_samples = max(0, checkpoint.consumed_samples - skipped)
        if rollback or not c.no_load_optim:  # pieces under single-device names: any layout
            with weight_catalog(checkpoint) as saved_weights:  # (masters, when the checkpoint kept none)
                load_optimizer(checkpoint.path, self.optimizer, self.model.module, saved_weights)
            return self.resumed_schedule(schedule, checkpoint, batch)
        state.lr_samples = 0  # (Megatron-LM loads the scheduler with the optimizer: without it the schedule restarts)
        return schedule

    def resumed_schedule(self, schedule: LRSchedule, checkpoint: CheckpointInfo, batch: int) -> LRSchedule:
        """The learning-rate schedule on resume, as Megatron-LM's scheduler loads its state: the
        checkpoint's peak, floor, warmup, decay length and style with
        --use-checkpoint-opt-param-scheduler, the flags' with --override-opt-param-scheduler, and
        otherwise the flags', with a warning where they differ from the checkpoint's (Megatron-LM
        refuses to go on there, so no script that runs in Megatron-LM trains differently here)."""
        s = self.config.lr_schedule
        if s.override_opt_param_scheduler:
            return schedule
        saved_config = checkpoint.config
        saved = LRSchedule.of(saved_config, saved_config.training.global_batch_size or batch).settings()
        if s.use_checkpoint_opt_param_scheduler:
            return schedule.with_settings(saved)
        ours = schedule.settings()
        changed = [name for name in ours if ours[name] != saved[name]]
        if changed:
            differences = ", ".join(f"{name} {ours[name]!r} (checkpoint: {saved[name]!r})" for name in changed)
            self.info(
                f"warning: the learning-rate schedule differs from the checkpoint's: {differences}; going on with "
                "the flags' (--override-opt-param-scheduler says so and silences this, "
                "--use-checkpoint-opt-param-scheduler takes the checkpoint's; Megatron-LM stops here)"
            )
        return schedule

    def rank_state(self, state: TrainState) -> dict[str, Any]:
        """What this rank needs beyond the weights and the optimizer state to resume exactly."""
        saved: dict[str, Any] = {
            "rng": rng.capture(self.precision.device),
            "skipped_iterations": state.skipped_iterations,
            "lr_schedule_samples": state.lr_samples,
        }
        if self.precision.scaler is not None:
            saved["loss_scaler"] = self.precision.scaler.state_dict()
        if self.model.rng_states is not None:
            saved["tensor_parallel_rng"] = dict(self.model.rng_states.states)
        return saved

    def restore_rank_state(self, saved: dict[str, Any], state: TrainState, own: bool = True) -> None:
        """Counters and loss scaler from `saved`; the random generators too when it is this rank's
        `own` (saved at the same layout; elsewhere they start from the seed) and --no-load-rng is not set."""
        if own and not self.config.checkpoint.no_load_rng:
            rng.restore(saved["rng"], self.precision.device)
            if self.model.rng_states is not None and "tensor_parallel_rng" in saved:
                self.model.rng_states.states.update(saved["tensor_parallel_rng"])
        state.skipped_iterations = int(saved.get("skipped_iterations", 0))
        state.lr_samples = int(saved.get("lr_schedule_samples", 0))
        if self.precision.scaler is not None and "loss_scaler" in saved:
            self.precision.scaler.load_state_dict(saved["loss_scaler"])
