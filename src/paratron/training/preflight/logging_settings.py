"""What the run's logging asks for: --profile's steps and ranks, and wandb installed when asked for."""

from __future__ import annotations

from paratron.config.schema import Config
from paratron.training.metrics import require_wandb
from paratron.training.profiling import check_profile_settings


def check_logging_settings(config: Config) -> None:
    """--profile's steps and ranks, and wandb installed when asked for (one-line errors)."""
    check_profile_settings(config.logging)
    require_wandb(config.logging)
