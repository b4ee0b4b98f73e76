"""Pieces the model and its mixture of experts share: several linear maps of one input kept as
one module (`Projections`, so that tensor parallelism can split them as one matrix: queries, keys
and values; an MLP's gate and up projections), and the MLP itself (a block's, or an MoE layer's
shared expert).

`Projections` computes its maps as one matmul over their concatenated weights (`model/fused_linear.py`),
LoRA-adapted ones included (each adapter's A joins the matmul, its update is added to its slice), so an
adapter whose B is zero leaves the outputs bit for bit those of the base model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.fused_linear import linears
from paratron.model.fused_ops import FusibleOp
from paratron.model.layer_kind import CheckpointNames, Column, KindWork, LayerKind, MicroBatchShare, Random, Row, Split
from paratron.model.lora import LoRALinear


class Projections(nn.ModuleDict):
    """Several linear maps of the same input, returned as a tuple in order (queries, keys and
    values; or gate and up). Kept together so parallelism can treat them as one matrix."""

    def __init__(self, in_features: int, out_features: dict[str, int], bias: bool) -> None:
        super().__init__({name: nn.Linear(in_features, size, bias=bias) for name, size in out_features.items()})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layers = list(self.values())
        if not all(_stackable(layer) for layer in layers):
            return tuple(layer(x) for layer in layers)
        sizes = [layer.out_features for layer in layers]
        adapted = [layer for layer in layers if isinstance(layer, LoRALinear)]
        params: list[torch.Tensor | None] = [p for layer in layers for p in (layer.weight, layer.bias)]
        params += [p for layer in adapted for p in (layer.lora_a, None)]
        stacked = linears(x, params)
        if adapted:
            stacked = _add_updates(stacked, layers, sizes)
        return tuple(stacked.split(sizes, dim=-1)) if len(layers) > 1 else (stacked,)


def _stackable(layer: nn.Module) -> bool:
    """Whether `layer` can join the one matmul: a plain or LoRA linear that nothing watches. Other
    linears (fp8's) compute their own way, and hooks (a parameter gather's, a debugger's) expect
    their layer to be called, so either makes the projections run layer by layer."""
    if type(layer) not in (nn.Linear, LoRALinear):
        return False
    hooks = (layer._forward_hooks, layer._forward_pre_hooks, layer._backward_hooks, layer._backward_pre_hooks)
    return not any(hooks)


def _add_updates(stacked: torch.Tensor, layers: list[nn.Module], sizes: list[int]) -> torch.Tensor:
    """The base outputs side by side plus each LoRA layer's s (x A^T) B^T on its slice (zeros on a
    plain layer's), as one tensor laid out as the base outputs alone are: an adapter whose B is zero
    changes no bit of what follows. (`stacked` ends with every adapter's x A^T, in layer order.)"""
    ranks = [layer.rank for layer in layers if isinstance(layer, LoRALinear)]
    base, *hidden = stacked.split([sum(sizes), *ranks], dim=-1)
    hidden_of = iter(hidden)
    updates = [
        layer.scaling * F.linear(next(hidden_of), layer.lora_b)
        if isinstance(layer, LoRALinear)
        else base.new_zeros(*base.shape[:-1], layer.out_features)
        for layer in layers
    ]
    return base + torch.cat(updates, dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) x up (the function a fused kernel compiles)."""
    return F.silu(gate) * up


_swiglu = FusibleOp(swiglu)


def ungated_activation(h: torch.Tensor, kind: str) -> torch.Tensor:
    """A non-gated MLP's activation by `activation_kind`: relu(h)^2 (Nemotron-4's squared ReLU), CLIP's quick GELU,
    or GELU exact ("none") or in its tanh approximation ("tanh", GPT-2's)."""
    if kind == "squared_relu":
        return F.relu(h).square()
    if kind == "quick_gelu":
        return h * torch.sigmoid(1.702 * h)
    return F.gelu(h, approximate=kind)


def activation_kind(config: ModelConfig) -> str:
    """What `ungated_activation` computes for `config`: squared_relu, quick_gelu, or GELU's approximation
    ("tanh" with --openai-gelu, else "none")."""
    if config.activation in ("squared_relu", "quick_gelu"):
        return config.activation
    return "tanh" if config.openai_gelu else "none"


class MLP(LayerKind):
    """GELU MLP (GPT; quick GELU, CLIP's), squared-ReLU MLP (Nemotron-4) or SwiGLU MLP (Llama): up-projection,
    activation, down-projection.
    `inner`, `bias` and `dropout` default to the config's (a shared expert sets its own)."""

    symbol, kind_name, slot = "-", "MLP", "mlp"

    # (its names in checkpoints)
    checkpoint_names = CheckpointNames(
        hf_module="mlp",
        hf_norm="post_attention_layernorm",
        hf_weights={"in_proj.{p}.weight": "{p}_proj.weight", "out_proj.weight": "down_proj.weight"},
        megatron_module="mlp",
        megatron_norm="pre_mlp_layernorm",
        megatron_fused_norm="linear_fc1.layer_norm",
        megatron_children={"in_proj": "linear_fc1", "out_proj": "linear_fc2"},
    )

    def __init__(
        self, config: ModelConfig, inner: int | None = None, bias: bool | None = None, dropout: float | None = None
    ) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, inner or config.ffn_hidden_size
        bias = config.add_bias_linear if bias is None else bias
        self.gated = config.activation == "swiglu"
        self.kind = activation_kind(config)
        self.swiglu_fusion = config.bias_swiglu_fusion
        self.in_proj = Projections(hidden, {"gate": inner, "up": inner} if self.gated else {"up": inner}, bias)
        self.out_proj = nn.Linear(inner, hidden, bias=bias)
        self.dropout = nn.Dropout(config.hidden_dropout if dropout is None else dropout)

    def tensor_parallel_plan(self) -> dict[str, Split]:
        """Up (and gate) column-parallel as one matrix, down row-parallel."""
        return {"in_proj": Column(), "out_proj": Row(), "dropout": Random(sequence_parallel_only=True)}

    @classmethod
    def matmul_weights(cls, config: ModelConfig) -> int:
        projections = 3 if config.activation == "swiglu" else 2
        return projections * config.hidden_size * config.ffn_hidden_size

    # ------------------------------------------------------------ the planner's terms

    @classmethod
    def activation_bytes(cls, config: ModelConfig, share: MicroBatchShare, selective: bool) -> float:
        """Per token, over this rank's f = MLP width / TP: SwiGLU keeps gate, up, silu(gate) and their product
        (4·w·f), quick GELU its input, sigmoid and output (3·w·f), GELU and squared ReLU their input and output
        (2·w·f). Plus the output dropout's mask."""
        kept = {"swiglu": 4, "quick_gelu": 3}.get(config.activation, 2)  # (quick GELU keeps its sigmoid too)
        f = config.ffn_hidden_size // share.tp
        return kept * share.width * f * share.tokens + share.output_dropout(config)

    @classmethod
    def forward_work(cls, config: ModelConfig, share: MicroBatchShare) -> KindWork:
        """Its up (and gate) and down projections, / TP."""
        projections = 3 if config.activation == "swiglu" else 2
        return KindWork(2 * share.tokens * projections * config.hidden_size * config.ffn_hidden_size / share.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.in_proj(x)
            h = _swiglu(self.swiglu_fusion, gate, up)
        else:
            (up,) = self.in_proj(x)
            h = ungated_activation(up, self.kind)
        return self.dropout(self.out_proj(h))
