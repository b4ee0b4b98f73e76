"""Named model sizes as models: their configs and exact parameter counts.

The entries themselves are settings, kept with the configuration (`config/presets.py`);
parameter counts (tests/unit/test_registry.py) match the published ones within 0.5%.
"""

from __future__ import annotations

from typing import Any

import torch

from paratron.config.presets import MODELS, PUBLISHED_ACTIVE_PARAMETERS, PUBLISHED_PARAMETERS, model_preset
from paratron.config.schema import ModelConfig
from paratron.model.gpt import GPT

__all__ = [
    "MODELS",
    "PUBLISHED_ACTIVE_PARAMETERS",
    "PUBLISHED_PARAMETERS",
    "model_config",
    "count_parameters",
    "count_active_parameters",
]


def model_config(name: str, **overrides: Any) -> ModelConfig:
    return ModelConfig(**{**model_preset(name), **overrides})


def count_parameters(config: ModelConfig) -> int:
    """Exact parameter count (shared tensors once), from a model built on the meta device."""
    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for p in model.parameters())


def expert_parameters(config: ModelConfig) -> int:
    """Parameters of one routed expert (its input and output projections)."""
    h = config.hidden_size
    ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
    return (3 if config.activation == "swiglu" else 2) * h * ffn


def count_active_parameters(config: ModelConfig) -> int:
    """Parameters one token uses: all of them but the experts it is not routed to."""
    idle = (config.num_experts or 0) - config.moe_router_topk if config.num_experts else 0
    return count_parameters(config) - sum(config.moe_layer_pattern) * idle * expert_parameters(config)
