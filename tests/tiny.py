"""Small configs shared by tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratron.config import Config, build_config


def tiny_config(run_dir: Path, **overrides: Any) -> Config:
    """The debug recipe, quiet: no progress bar, no TensorBoard, metrics every step."""
    values: dict[str, Any] = dict(
        run_dir=str(run_dir), progress_bar=False, tensorboard=False, log_interval=1, eval_iters=0
    )
    values.update(overrides)
    return build_config(values, recipe="debug")
