"""Named model sizes as models: their configs and exact parameter counts.

The entries themselves are settings, kept with the configuration (`config/presets.py`);
parameter counts (tests/unit/test_registry.py) match the published ones within 0.5%.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from paratron.config.presets import MODELS, PUBLISHED_PARAMETERS, model_preset
from paratron.config.schema import ModelConfig
from paratron.model.gpt import GPT

__all__ = ["MODELS", "PUBLISHED_PARAMETERS", "model_config", "count_parameters"]


def model_config(name: str, **overrides: Any) -> ModelConfig:
    return dataclasses.replace(ModelConfig(), **{**model_preset(name), **overrides})


def count_parameters(config: ModelConfig) -> int:
    """Exact parameter count (shared tensors once), from a model built on the meta device."""
    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for p in model.parameters())
