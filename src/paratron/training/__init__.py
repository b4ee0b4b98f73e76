"""The training loop, one step, metrics, plots and FLOPs accounting."""

from paratron.training.loop import Trainer
from paratron.training.resume import TrainState
from paratron.training.run import run_training

__all__ = ["Trainer", "TrainState", "run_training"]
