"""Sample-based run arithmetic: the global batch size over a run with
--rampup-batch-size (as Megatron-LM's `RampupBatchsizeNumMicroBatchesCalculator` works it out),
the number of steps a run of --train-samples takes (`config.loading` derives `train_iters` from it),
and the learning-rate schedule's warmup and decay lengths in samples (`optim.lr_schedule`).

The batch starts at START and grows by INCREMENT each time another
SAMPLES / ((GLOBAL - START) / INCREMENT) samples have been consumed; once more than SAMPLES
samples are consumed it is the full --global-batch-size.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratron.config.schema import LRScheduleConfig, TrainingConfig


@dataclass(frozen=True)
class BatchRamp:
    """--rampup-batch-size START INCREMENT SAMPLES towards `global_batch_size`."""

    start: int
    increment: int
    samples: int
    global_batch_size: int

    @property
    def samples_per_increment(self) -> float:
        """Samples consumed between two increments (a float, as Megatron-LM computes it)."""
        return self.samples / ((self.global_batch_size - self.start) // self.increment)

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples."""
        if consumed_samples > self.samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.samples_per_increment)
        return self.start + steps * self.increment

    def train_iters(self, train_samples: int) -> int:
        """Steps of a run of `train_samples` samples (Megatron-LM's `update_train_iters`): the ramp's
        steps while at most SAMPLES and at most `train_samples` samples were consumed, then whole
        full batches of what is left (a partial last batch is dropped)."""
        iterations, consumed = 0, 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.batch_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


def sample_based_train_iters(
    train_samples: int, global_batch_size: int, rampup: tuple[int, int, int] | None
) -> int | None:
    """Steps of a run of --train-samples `train_samples` (a partial last batch is dropped); None
    when the numbers make no run (validation names the setting)."""
    if train_samples < 0 or global_batch_size < 1:
        return None
    if rampup is None:
        return train_samples // global_batch_size
    ramp = batch_ramp(rampup, global_batch_size)
    return None if ramp is None else ramp.train_iters(train_samples)


def batch_ramp(rampup: tuple[int, int, int] | None, global_batch_size: int) -> BatchRamp | None:
    """The ramp of --rampup-batch-size `rampup`, None when not given or when it cannot ramp (a start
    that is not below the global batch, an increment that does not step to it, no samples)."""
    if rampup is None:
        return None
    start, increment, samples = rampup
    if start < 1 or increment < 1 or samples < 1 or start >= global_batch_size:
        return None
    if (global_batch_size - start) % increment:
        return None
    return BatchRamp(start, increment, samples, global_batch_size)


@dataclass(frozen=True)
class ScheduleLengths:
    """The learning-rate schedule's lengths in samples (Megatron-LM's `get_optimizer_param_scheduler`)."""

    warmup: float
    """A float with --lr-warmup-fraction, as in Megatron-LM."""
    decay: int
    wsd_decay: int | None


def schedule_lengths(schedule: LRScheduleConfig, training: TrainingConfig, global_batch_size: int) -> ScheduleLengths:
    """Iteration flags count `global_batch_size` samples per step; sample flags are taken as they
    are; the decay defaults to the whole run and --lr-warmup-fraction is a share of the decay."""
    s, t = schedule, training
    if t.train_samples is None:
        decay = (s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters) * global_batch_size
        wsd = s.lr_wsd_decay_iters * global_batch_size if s.lr_wsd_decay_iters is not None else None
        warmup: float = s.lr_warmup_iters * global_batch_size
    else:
        decay = s.lr_decay_samples if s.lr_decay_samples is not None else t.train_samples
        wsd = s.lr_wsd_decay_samples
        warmup = s.lr_warmup_samples
    if s.lr_warmup_fraction is not None:
        warmup = s.lr_warmup_fraction * decay
    return ScheduleLengths(warmup, decay, wsd)
