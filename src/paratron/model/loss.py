"""The language-modeling loss of a single-device model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratron.model.batch import IGNORE_INDEX


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of every position [B, T], in fp32 whatever the compute precision;
    zero where the label is IGNORE_INDEX."""
    flat = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return flat.view(labels.shape)


def mean_loss(losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean of per-token losses over the trained labels (zero when none is)."""
    return losses.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the trained labels."""
    return mean_loss(token_losses(logits, labels), labels)
