"""Pieces the model and its mixture of experts share: several linear maps of one input kept as
one module (`Projections`, so that tensor parallelism can split them as one matrix: queries, keys
and values; an MLP's gate and up projections), and the MLP itself (a block's, or an MoE layer's
shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config.schema import ModelConfig


class Projections(nn.ModuleDict):
    """Several linear maps of the same input, returned as a tuple in order (queries, keys and
    values; or gate and up). Kept together so parallelism can treat them as one matrix."""

    def __init__(self, in_features: int, out_features: dict[str, int], bias: bool) -> None:
        super().__init__({name: nn.Linear(in_features, size, bias=bias) for name, size in out_features.items()})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(linear(x) for linear in self.values())


class MLP(nn.Module):
    """GELU MLP (GPT; quick GELU, CLIP's) or SwiGLU MLP (Llama): up-projection, activation, down-projection.
    `inner`, `bias` and `dropout` default to the config's (a shared expert sets its own)."""

    def __init__(
        self, config: ModelConfig, inner: int | None = None, bias: bool | None = None, dropout: float | None = None
    ) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, inner or config.ffn_hidden_size
        bias = config.add_bias_linear if bias is None else bias
        self.gated = config.activation == "swiglu"
        self.quick = config.activation == "quick_gelu"
        self.gelu = "tanh" if config.openai_gelu else "none"  # GPT-2's approximation, or the exact GELU
        self.in_proj = Projections(hidden, {"gate": inner, "up": inner} if self.gated else {"up": inner}, bias)
        self.out_proj = nn.Linear(inner, hidden, bias=bias)
        self.dropout = nn.Dropout(config.hidden_dropout if dropout is None else dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.in_proj(x)
            h = F.silu(gate) * up
        else:
            (up,) = self.in_proj(x)
            h = up * torch.sigmoid(1.702 * up) if self.quick else F.gelu(up, approximate=self.gelu)
        return self.dropout(self.out_proj(h))
