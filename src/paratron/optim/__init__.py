"""Optimizers behind one protocol (`protocol.py`), mixed precision and loss scaling, learning-rate
schedules and gradient clipping."""

from paratron.optim.build import build_optimizer, clip_grad_norm
from paratron.optim.lr_schedule import LRSchedule
from paratron.optim.master_weights import parameter_groups
from paratron.optim.protocol import GradsForNorm, TrainingOptimizer

__all__ = [
    "build_optimizer",
    "clip_grad_norm",
    "parameter_groups",
    "LRSchedule",
    "GradsForNorm",
    "TrainingOptimizer",
]
