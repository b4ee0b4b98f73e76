"""The one table from --precision's names to torch dtypes (the compute dtype of a run)."""

from __future__ import annotations

import torch

PRECISION_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""--precision's name -> the dtype weights and activations compute in."""
