"""The language-modeling loss of a single-device model."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the compute precision."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
