"""The model's norms: LayerNorm and RMSNorm, each with zero-centred gamma (--apply-layernorm-1p), over the hidden size
or another width (the query/key norms, multi-latent attention's latent norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.fused_ops import FusibleOp


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm with zero-centred gamma (--apply-layernorm-1p): the scale applied is 1 + weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


_rms_norm = FusibleOp(F.rms_norm)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same parameter), run as one compiled kernel where `fused` (--persist-layer-norm) is in effect."""

    def __init__(self, size: int, eps: float, fused: bool | None = None) -> None:
        super().__init__(size, eps=eps)
        self.fused = fused

    def scale(self) -> torch.Tensor | None:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self.fused, x, tuple(self.normalized_shape), self.scale(), self.eps)


class RMSNorm1P(RMSNorm):
    """RMSNorm with zero-centred gamma (--apply-layernorm-1p): the scale applied is 1 + weight."""

    def scale(self) -> torch.Tensor | None:
        return self.weight + 1


def make_norm(config: ModelConfig, size: int | None = None) -> nn.Module:
    """The model's norm over `size` features (default: the hidden size)."""
    size = size or config.hidden_size
    if config.normalization == "RMSNorm":
        rms = RMSNorm1P if config.apply_layernorm_1p else RMSNorm
        return rms(size, config.norm_epsilon, config.persist_layer_norm)
    return (LayerNorm1P if config.apply_layernorm_1p else nn.LayerNorm)(size, eps=config.norm_epsilon)
