"""Consistency checks of a whole configuration, run before any worker process starts.

`validate(config, world_size)` runs the groups of `config.checks` in order and returns the run's `Layout`.
Each failure is a ConfigError whose one-line message names the flag (taken from the field, see
`fields.flag`) and the fix. These checks read settings only; the files a run will read are checked
with them before launch (`training.preflight`).
"""

from __future__ import annotations

from paratron.config.checks.batch_schedule import check_step_batch_schedule
from paratron.config.checks.bounds import check_bounds
from paratron.config.checks.data import check_data_settings, parse_split
from paratron.config.checks.debugging import check_debug_capture, check_loss_spikes
from paratron.config.checks.eval_tasks import check_eval_tasks
from paratron.config.checks.fim import check_fim
from paratron.config.checks.launch import check_launch
from paratron.config.checks.lr_schedule import check_lr_schedule, check_sample_based
from paratron.config.checks.model import check_model, check_rotary
from paratron.config.checks.parallel import (
    check_context_parallel,
    check_data_parallel,
    check_expert_parallel,
    check_tensor_parallel,
)
from paratron.config.checks.pattern import check_layer_pattern
from paratron.config.checks.precision import check_fp8_settings, check_gradient_precision, check_precision
from paratron.config.checks.recompute import check_recompute
from paratron.config.checks.vision import check_added_image_token, check_vision_layout, check_vision_model
from paratron.config.faults import parse_faults
from paratron.config.layout import Layout, resolve_layout
from paratron.config.schema import Config

__all__ = ["parse_split", "validate"]  # (parse_split: a --split's shares, read by the data pipeline too)


def validate(config: Config, world_size: int, check_data: bool = True, needs_source: bool = True) -> Layout:
    """Raise ConfigError for the first inconsistent setting of a run on `world_size` processes;
    return the run's layout. `check_data=False` skips the data section (for library use that
    brings its own data); `needs_source=False` checks the data settings given but asks for no data
    source (for `--dry-run`, which reads no data)."""
    check_bounds(config)
    check_launch(config.parallel)
    check_precision(config.training)
    check_model(config.model, config.data)
    check_layer_pattern(config)
    check_vision_model(config.model, config.data.seq_length)
    check_added_image_token(config)
    check_rotary(config)
    check_step_batch_schedule(config, world_size)
    layout = resolve_layout(config, world_size)
    check_vision_layout(config, layout)
    check_tensor_parallel(config, layout)
    check_expert_parallel(config, layout)
    check_context_parallel(config, layout)
    check_recompute(config.training)
    check_data_parallel(config, layout)
    check_lr_schedule(config)
    check_sample_based(config, layout)
    check_eval_tasks(config, layout)
    check_debug_capture(config)
    parse_faults(config.training.fault_inject, world_size)
    check_loss_spikes(config)
    check_gradient_precision(config)
    check_fp8_settings(config, layout)
    if check_data:
        check_data_settings(config.data, config.training, config.model, needs_source)
        check_fim(config.data)
    return layout
