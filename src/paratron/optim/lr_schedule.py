"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to min_lr."""

from __future__ import annotations

import math

from paratron.config.schema import LRScheduleConfig


def learning_rate(iteration: int, max_lr: float, schedule: LRScheduleConfig, train_iters: int) -> float:
    """Learning rate of the `iteration`-th optimizer step (1-based).

    Warmup: lr = max_lr x iteration / warmup for iteration <= warmup. Then, with
    progress = (iteration - warmup) / (decay_iters - warmup) clipped to [0, 1]:
    cosine: min + (max - min) x (1 + cos(pi x progress)) / 2; linear: max - (max - min) x progress;
    constant: max. After decay_iters the rate stays at min_lr (max_lr for constant).
    """
    warmup = schedule.lr_warmup_iters
    decay_iters = schedule.lr_decay_iters or train_iters
    if warmup > 0 and iteration <= warmup:
        return max_lr * iteration / warmup
    if schedule.lr_decay_style == "constant":
        return max_lr
    span = max(1, decay_iters - warmup)
    progress = min(1.0, max(0.0, (iteration - warmup) / span))
    min_lr = schedule.min_lr
    if schedule.lr_decay_style == "linear":
        return max_lr - (max_lr - min_lr) * progress
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
