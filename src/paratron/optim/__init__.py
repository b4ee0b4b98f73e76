"""Optimizer construction, learning-rate schedules and gradient clipping."""

from paratron.optim.build import build_optimizer, clip_grad_norm, parameter_groups, set_learning_rate
from paratron.optim.lr_schedule import learning_rate

__all__ = ["build_optimizer", "clip_grad_norm", "parameter_groups", "set_learning_rate", "learning_rate"]
