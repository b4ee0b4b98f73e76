"""The learning-rate schedule, as Megatron-LM's `OptimizerParamScheduler` computes it.

The schedule is counted in samples: before a step, the rate is that of the samples all earlier
applied steps trained (a skipped step trains none), so the first step runs at --lr-warmup-init
when there is a warmup. Iteration flags are turned into samples with --global-batch-size
(Megatron-LM's `get_optimizer_param_scheduler`):

    warmup  = --lr-warmup-fraction x decay, else --lr-warmup-iters x batch (--lr-warmup-samples)
    decay   = --lr-decay-iters x batch (--lr-decay-samples), default --train-iters x batch
              (--train-samples)
    wsd     = --lr-wsd-decay-iters x batch (--lr-wsd-decay-samples)

With n samples trained, max the group's peak (--lr, or --decoupled-lr for the embedding and
output layer) and min its floor:

    n <= warmup (warmup > 0):  init + (max - init) x n / warmup
    constant:                  max
    n > decay:                 min
    inverse-square-root:       max(min, max x sqrt(max(warmup, 1)) / sqrt(max(n, 1)))
    otherwise, r = (n - warmup) / (decay - warmup):
      linear  min + (max - min) x (1 - r);   cosine  min + (max - min) x (1 + cos(pi r)) / 2
      WSD     max until decay - wsd, then with s = (n - (decay - wsd)) / wsd the annealing shape
              (exponential 2 x 0.5^s - 1, linear 1 - s, cosine (1 + cos(pi s)) / 2, minus_sqrt 1 - sqrt(s))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from paratron.config.samples import schedule_lengths
from paratron.config.schema import Config


@dataclass(frozen=True)
class LRSchedule:
    """A run's schedule in samples (the numbers Megatron-LM's scheduler holds)."""

    max_lr: float
    min_lr: float
    init_lr: float
    warmup_steps: float
    """Samples of warmup (a float with --lr-warmup-fraction, as in Megatron-LM)."""
    decay_steps: int
    decay_style: str
    wsd_decay_steps: int | None = None
    wsd_decay_style: str = "exponential"

    @classmethod
    def of(cls, config: Config, global_batch_size: int) -> LRSchedule:
        """The schedule of `config`, whose (full) global batch is `global_batch_size` samples."""
        s = config.lr_schedule
        lengths = schedule_lengths(s, config.training, global_batch_size)
        return cls(
            float(config.optimizer.lr),
            s.min_lr,
            s.lr_warmup_init,
            lengths.warmup,
            lengths.decay,
            s.lr_decay_style,
            lengths.wsd_decay,
            s.lr_wsd_decay_style,
        )

    def settings(self) -> dict[str, Any]:
        """What a resume compares with the checkpoint's (Megatron-LM's checked scheduler values)."""
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.decay_style,
        }

    def with_settings(self, settings: Mapping[str, Any]) -> LRSchedule:
        """This schedule with the checked values of `settings` (--use-checkpoint-opt-param-scheduler)."""
        return replace(self, **settings)

    def at(self, samples: int, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The rate after `samples` trained samples, for a group peaking at `max_lr` (default the
        schedule's) with floor `min_lr` (default the schedule's)."""
        top = self.max_lr if max_lr is None else max_lr
        floor = self.min_lr if min_lr is None else min_lr
        if self.warmup_steps > 0 and samples <= self.warmup_steps:
            return self.init_lr + (top - self.init_lr) * float(samples) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return top
        if samples > self.decay_steps:
            return floor
        if self.decay_style == "inverse-square-root":
            warmup, steps = max(self.warmup_steps, 1), max(samples, 1)
            return max(floor, top * warmup**0.5 / (steps**0.5))
        ratio = float(samples - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        return floor + self._coefficient(samples, ratio) * (top - floor)

    def _coefficient(self, samples: int, ratio: float) -> float:
        """How far above the floor the rate is, as a fraction of (max - min)."""
        if self.decay_style == "linear":
            return 1.0 - ratio
        if self.decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.decay_style != "WSD":
            raise ValueError(f"unknown learning-rate decay style {self.decay_style!r}")
        assert self.wsd_decay_steps is not None
        anneal_start = self.decay_steps - self.wsd_decay_steps
        if samples <= anneal_start:
            return 1.0
        progress = float(samples - anneal_start) / float(self.wsd_decay_steps)
        if self.wsd_decay_style == "linear":
            return 1.0 - progress
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * progress) + 1.0)
        if self.wsd_decay_style == "exponential":
            return (2.0 * math.pow(0.5, progress)) - 1.0
        return 1.0 - math.sqrt(progress)  # minus_sqrt

    def apply(self, param_groups: Sequence[dict[str, Any]], samples: int) -> float:
        """Set every group's "lr" for the step after `samples` trained samples (a group with its own
        "max_lr" / "min_lr", the decoupled embedding and output layer, follows those); returns the
        rate of the main groups (the one logged)."""
        for group in param_groups:
            group["lr"] = self.at(samples, group.get("max_lr"), group.get("min_lr"))
        return self.at(samples)
