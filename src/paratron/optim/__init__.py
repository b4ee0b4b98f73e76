"""Optimizers behind one protocol (`protocol.py`), mixed precision and loss scaling, learning-rate
schedules and gradient clipping."""

from paratron.optim.build import build_optimizer, clip_grad_norm, set_learning_rate
from paratron.optim.lr_schedule import LRSchedule, learning_rate
from paratron.optim.master_weights import parameter_groups
from paratron.optim.protocol import GradsForNorm, TrainingOptimizer

__all__ = [
    "build_optimizer",
    "clip_grad_norm",
    "parameter_groups",
    "set_learning_rate",
    "learning_rate",
    "LRSchedule",
    "GradsForNorm",
    "TrainingOptimizer",
]
