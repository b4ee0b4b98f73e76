"""Sample-based run arithmetic: the global batch size over a run whose batch changes with the samples
consumed (`BatchSchedule`), made from --rampup-batch-size (Megatron-LM's linear ramp, as core 0.16.1's
`RampupBatchsizeNumMicroBatchesCalculator` works it out) or from --step-batch-size-schedule (Megatron-LM
main's `StepBatchsizeNumMicroBatchesCalculator`); the number of steps a run of --train-samples takes
(`config.loading` derives `train_iters` from it); and the learning-rate schedule's warmup and decay
lengths in samples (`optim.lr_schedule`).

The ramp's batch starts at START and grows by INCREMENT each time another
SAMPLES / ((GLOBAL - START) / INCREMENT) samples have been consumed; once more than SAMPLES
samples are consumed it is the full --global-batch-size. The step schedule "0:B0 T1:B1 ..." trains
batches of B0 samples until T1 tokens (T1 // --seq-length samples) are consumed, then B1, and so on.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from paratron.config.schema import LRScheduleConfig, TrainingConfig


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch of every step as a function of the samples consumed before it: what the
    training loop, the data order, --train-samples and a resumed run read, whichever flag made it."""

    steps: tuple[tuple[int, int], ...]
    """(consumed samples from which it applies, global batch): thresholds strictly rising from 0."""
    counts_partial_batch: bool
    """Whether a --train-samples run's last, partial batch is still a step (the step schedule, as in
    Megatron-LM main) or dropped (the ramp, as at core 0.16.1)."""
    stepped_until: int
    """`train_iters` counts steps one by one while fewer samples than this are consumed: the last
    threshold, or the ramp's SAMPLES + 1 (core 0.16.1 counts a step at exactly SAMPLES too)."""

    @property
    def global_batch_size(self) -> int:
        """The batch the schedule ends at."""
        return self.steps[-1][1]

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples."""
        index = bisect.bisect_right(self.steps, consumed_samples, key=lambda step: step[0]) - 1
        return self.steps[max(index, 0)][1]

    def batch_sizes(self) -> tuple[int, ...]:
        """Every global batch the schedule trains, in order."""
        return tuple(batch for _, batch in self.steps)

    def train_iters(self, train_samples: int) -> int:
        """Steps of a run of `train_samples` samples (Megatron-LM's `update_train_iters`): step through
        the changing part of the schedule, then whole batches of the last size for what is left."""
        iterations, consumed = 0, 0
        while consumed < self.stepped_until and (
            consumed < train_samples or (consumed == train_samples and not self.counts_partial_batch)
        ):
            consumed += self.batch_at(consumed)
            iterations += 1
        left = train_samples - consumed
        if left > 0:
            whole, partial = divmod(left, self.global_batch_size)
            iterations += whole + (1 if partial and self.counts_partial_batch else 0)
        return iterations


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

    def schedule(self) -> BatchSchedule:
        """The ramp as a schedule: each increment from the first sample count whose `batch_at` reaches
        it (found with the same float arithmetic, so both agree at every count)."""
        steps = [(0, self.start)]
        per = self.samples_per_increment
        for k in range(1, (self.global_batch_size - self.start) // self.increment + 1):
            first = max(0, int(k * per) - 2)
            while first <= self.samples and self.batch_at(first) < self.start + k * self.increment:
                first += 1
            if first > self.samples:
                break
            steps.append((first, self.batch_at(first)))
        if steps[-1][1] != self.global_batch_size:
            steps.append((self.samples + 1, self.global_batch_size))
        return BatchSchedule(_merged(steps), counts_partial_batch=False, stepped_until=self.samples + 1)


def _merged(steps: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """`steps` without entries that repeat the batch before them or share its threshold (the later wins)."""
    out: list[tuple[int, int]] = []
    for threshold, batch in steps:
        if out and out[-1][0] == threshold:
            out.pop()
        if not out or out[-1][1] != batch:
            out.append((threshold, batch))
    return tuple(out)


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _amount(text: str) -> int:
    """A count with an optional K/M/B/T suffix ("2.4B"), as Megatron-LM reads it (ValueError when not one)."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    try:
        number = float(text[:-1] if scale != 1 else text)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{text!r} is not a count (a number with an optional suffix K, M, B or T)")
    return int(number * scale)


def step_schedule(text: str, seq_length: int) -> BatchSchedule:
    """--step-batch-size-schedule "THRESHOLD:BATCH ...": thresholds in tokens (Megatron-LM's training
    passes --seq-length, so they become samples by // seq_length), batches in samples. ValueError names
    what is wrong: an entry without a colon, a bad count, a first threshold other than 0, thresholds
    that do not rise (in samples), a batch below 1."""
    steps: list[tuple[int, int]] = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH")
        threshold, batch = entry.split(":", 1)
        steps.append((_amount(threshold) // seq_length, _amount(batch)))
    if not steps:
        raise ValueError("no THRESHOLD:BATCH entries")
    if steps[0][0] != 0:
        raise ValueError(f"the first threshold must be 0, not {text.split()[0].split(':')[0]}")
    for (before, _), (after, _) in zip(steps, steps[1:]):
        if after <= before:
            raise ValueError(
                f"thresholds must rise (in samples of {seq_length} tokens): {after} samples comes after {before}"
            )
    if any(batch < 1 for _, batch in steps):
        raise ValueError("every batch must be at least 1")
    return BatchSchedule(tuple(steps), counts_partial_batch=True, stepped_until=steps[-1][0])


def batch_schedule(training: TrainingConfig, global_batch_size: int, seq_length: int) -> BatchSchedule | None:
    """The run's changing batch: --step-batch-size-schedule's or --rampup-batch-size's, None for a
    constant batch (or one that validation refuses)."""
    text = training.step_schedule_text()
    if text is not None:
        try:
            return step_schedule(text, seq_length)
        except ValueError:
            return None
    try:
        ramp = batch_ramp(training.rampup(), global_batch_size)
    except ValueError:
        return None
    return None if ramp is None else ramp.schedule()


def sample_based_train_iters(train_samples: int, global_batch_size: int, schedule: BatchSchedule | None) -> int | None:
    """Steps of a run of --train-samples `train_samples` (a partial last batch is dropped with a
    constant batch); None when the numbers make no run (validation names the setting)."""
    if train_samples < 0 or global_batch_size < 1:
        return None
    if schedule is None:
        return train_samples // global_batch_size
    return schedule.train_iters(train_samples)


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
