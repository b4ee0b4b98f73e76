"""LoRA adapters (Hu et al., 2021): a frozen linear layer plus a trained low-rank update.

    y = x W^T + b + (alpha / rank) (x A^T) B^T        A [rank, in], B [out, rank]

`add_adapters` swaps the targeted `nn.Linear` layers of the transformer blocks for `LoRALinear`
(the same `weight` and `bias` objects under the same names, so base-model checkpoints load
unchanged) and freezes every other parameter. It runs on the meta device, before weights exist;
tensor parallelism then splits each adapter with its base layer (`parallel/tensor/layers.py`).

    target  layers (per block)                   paratron names
    qkv     attention query, key, value          layers.{i}.attention.in_proj.{q,k,v}
    proj    attention output projection          layers.{i}.attention.out_proj
    fc1     MLP gate (SwiGLU) and up projections layers.{i}.mlp.in_proj.{gate,up}
    fc2     MLP down projection                  layers.{i}.mlp.out_proj

A starts uniform in +-1/sqrt(in) and B at zero (as in peft), so training starts from the base
model. This module imports nothing from the rest of `model/`: `gpt.py` imports it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config.schema import LORA_TARGETS
from paratron.errors import ConfigError

ADAPTER_PARTS = ("lora_a", "lora_b")


def parse_targets(text: str) -> tuple[str, ...]:
    """The layers named by --lora-targets, in the order given (duplicates dropped)."""
    targets: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item not in LORA_TARGETS:
            raise ConfigError(f"--lora-targets {item}: unknown layer; choose from {', '.join(LORA_TARGETS)}")
        if item not in targets:
            targets.append(item)
    if not targets:
        raise ConfigError(f"--lora-targets {text!r}: names no layer; choose from {', '.join(LORA_TARGETS)}")
    return tuple(targets)


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank adapter beside it. It holds the replaced layer's own
    `weight` and `bias` Parameters, so their names (and checkpoints) stay those of the base model."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float) -> None:
        nn.Module.__init__(self)  # (not nn.Linear's: it would allocate a new weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.scaling * F.linear(F.linear(x, self.lora_a), self.lora_b)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def _targeted_slots(block: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[nn.Module, str]]:
    """(parent module, child name) of every linear layer of `block` that `targets` names."""
    attention, mlp = block.attention, block.mlp
    if "qkv" in targets:
        yield from ((attention.in_proj, name) for name in attention.in_proj.keys())
    if "proj" in targets:
        yield attention, "out_proj"
    if "fc1" in targets:
        yield from ((mlp.in_proj, name) for name in mlp.in_proj.keys())
    if "fc2" in targets:
        yield mlp, "out_proj"


def add_adapters(model: nn.Module, rank: int, alpha: float, targets: str) -> None:
    """Put LoRA adapters on the targeted layers of every block of `model.layers` and freeze every
    other parameter. Layers that already have one keep it (so calling twice changes nothing).
    On a model whose weights exist, the new adapters are initialized (A from a generator seeded
    by the adapter's name, B zero); on the meta device, initialization is left to the caller."""
    if rank < 1:
        raise ConfigError(f"--lora-rank {rank}: must be at least 1")
    chosen = parse_targets(targets)
    added: list[nn.Parameter] = []
    for block in model.layers:
        for parent, name in _targeted_slots(block, chosen):
            linear = getattr(parent, name)
            if isinstance(linear, LoRALinear):
                continue
            if type(linear) is not nn.Linear:
                raise ValueError(f"cannot adapt a {type(linear).__name__}: add adapters before parallelizing")
            adapted = LoRALinear(linear, rank, alpha)
            setattr(parent, name, adapted)
            added += [adapted.lora_a, adapted.lora_b]
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    fresh = {id(p) for p in added}
    for name, param in model.named_parameters():
        if id(param) in fresh and not param.is_meta:
            init_adapter(name, param, _generator_for(name, param.device))


def _generator_for(name: str, device: torch.device) -> torch.Generator:
    """A generator seeded by `name` alone, so adapters added to a built model are reproducible."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(hashlib.sha256(f"lora/{name}".encode()).digest()[:8], "little") >> 1)
    return generator


def init_adapter(name: str, tensor: torch.Tensor, generator: torch.Generator) -> bool:
    """Initialize `tensor` (the whole single-device tensor) if `name` is an adapter's, as peft
    does: A uniform in +-1/sqrt(in_features) (Kaiming-uniform with a = sqrt(5)), B zero, so the
    adapted model starts equal to the base model. Returns whether `name` was an adapter."""
    part = name.rsplit(".", 1)[-1]
    if part not in ADAPTER_PARTS:
        return False
    with torch.no_grad():
        if part == "lora_a":
            bound = 1.0 / math.sqrt(tensor.shape[1])
            tensor.uniform_(-bound, bound, generator=generator)
        else:
            tensor.zero_()
    return True


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter matrix (A or B)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARTS


def adapted_layers(names: Iterable[str]) -> list[str]:
    """The layers (name prefixes such as `layers.0.attention.in_proj.q`) that carry an adapter."""
    return [name.removesuffix(".lora_a") for name in names if name.endswith(".lora_a")]


def merge_adapters(state: dict[str, torch.Tensor], alpha: float, rank: int) -> dict[str, torch.Tensor]:
    """A single-device state dict without adapters: each adapted weight becomes
    W + (alpha / rank) B A (computed in fp32, stored in W's type), for export as a plain model."""
    scaling = alpha / rank
    merged = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for layer in adapted_layers(state):
        weight = state[f"{layer}.weight"]
        update = state[f"{layer}.lora_b"].float() @ state[f"{layer}.lora_a"].float()
        merged[f"{layer}.weight"] = (weight.float() + scaling * update).to(weight.dtype)
    return merged
