"""Activation recomputation: a granularity with the method and layer count it needs."""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.schema import TrainingConfig
from paratron.errors import ConfigError


def check_recompute(t: TrainingConfig) -> None:
    """Full recomputation names its method (and, by block, its layers); the others name neither."""
    if t.recompute_granularity == "full" and t.recompute_method is None:
        raise ConfigError(f"{flag.recompute_granularity} full needs {flag.recompute_method} uniform or block")
    if t.recompute_granularity != "full" and (t.recompute_method is not None or t.recompute_num_layers is not None):
        raise ConfigError(
            f"{flag.recompute_method} and {flag.recompute_num_layers} apply to "
            f"{flag.recompute_granularity} full; add it or drop them"
        )
    if t.recompute_method == "block" and t.recompute_num_layers is None:
        raise ConfigError(
            f"{flag.recompute_method} block needs {flag.recompute_num_layers} (layers per pipeline chunk)"
        )
