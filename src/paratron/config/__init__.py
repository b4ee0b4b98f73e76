"""Typed configuration: schema (frozen dataclasses), loading (YAML, CLI, Megatron names), the
layout arithmetic (the parallel sizes, the batches, the pipeline plan), validation."""

from paratron.config.dims import ParallelDims
from paratron.config.layout import BatchPlan, Layout, resolve_layout
from paratron.config.loading import build_config, config_from_dict, config_to_dict, override
from paratron.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LRScheduleConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PlanningConfig,
    TrainingConfig,
)
from paratron.config.validation import validate

__all__ = [
    "Config",
    "ModelConfig",
    "ParallelConfig",
    "OptimizerConfig",
    "LRScheduleConfig",
    "DataConfig",
    "TrainingConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "PlanningConfig",
    "build_config",
    "config_from_dict",
    "config_to_dict",
    "override",
    "validate",
    "Layout",
    "BatchPlan",
    "ParallelDims",
    "resolve_layout",
]
