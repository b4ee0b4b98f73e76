"""Data: tokenizers, preprocessing into Megatron indexed datasets, GPT samples, blending, micro-batches.

Names are imported on first use (the tokenizing workers of `preprocess` import only what they need).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlendedDataset": "blending",
    "parse_blend": "blending",
    "DataBundle": "build",
    "build_data": "build",
    "MockTokens": "datasets",
    "SampleSource": "datasets",
    "GPTDataset": "gpt_dataset",
    "build_sample_indices": "gpt_dataset",
    "IndexedDataset": "indexed",
    "IndexedDatasetWriter": "indexed",
    "BatchPlan": "loader",
    "micro_batches": "loader",
    "preprocess": "preprocess",
    "NullTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_byte_level_bpe": "tokenizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"paratron.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'paratron.data' has no attribute {name!r}")
