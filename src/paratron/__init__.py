"""paratron: train large Transformer language models with tensor, pipeline and data parallelism.

Public API:
    initialize_megatron, get_args   Megatron-LM-style entry points (dict of Megatron argument names)
    build_config, Config            the typed configuration
    build_model, model_config, GPT  the model family and its named sizes
    load_pretrained                 a single-device model from a checkpoint

Names are imported on first use, so `import paratron.data.preprocess` (what tokenizing
worker processes do) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "initialize_megatron": "paratron.megatron_api",
    "get_args": "paratron.megatron_api",
    "build_config": "paratron.config",
    "Config": "paratron.config",
    "build_model": "paratron.model",
    "model_config": "paratron.model",
    "GPT": "paratron.model",
    "load_pretrained": "paratron.checkpoint.pretrained",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'paratron' has no attribute {name!r}")
