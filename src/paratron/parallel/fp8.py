"""fp8 training of the linear layers through torchao's float8 training (--fp8-format, --fp8-recipe).

paratron does not implement fp8 matmuls itself: where the device has them (CUDA compute capability 8.9 and
newer) and torchao is installed, `convert_to_float8` swaps the transformer layers' `nn.Linear`s for torchao's
`Float8Linear` (scaled fp8 matmuls forward and backward, bf16 weights and optimizer state kept). The output
layer stays in bf16, as in Megatron-LM. `check_fp8` refuses every other case in one line before training.
Tests run the conversion on the CPU with torchao's emulated fp8 matmuls (`EMULATE_VARIABLE`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os

import torch
from torch import nn

from paratron.config.fields import flag
from paratron.config.schema import TrainingConfig
from paratron.distributed.init import has_fp8_matmuls
from paratron.errors import ConfigError
from paratron.parallel.tensor.float8 import FP8_TWINS, Float8Matmul, retype
from paratron.parallel.tensor.layers import ColumnParallelProjections

FP8_DIVISOR = 16
"""fp8 matmuls need both sides of a weight to be multiples of this."""


def check_fp8(training: TrainingConfig, device_type: str) -> None:
    """With --fp8-format: a ConfigError (one line) where the device (a type: cuda, cpu, ...) has no fp8
    matmuls, or where torchao, which paratron's fp8 training runs through, is not installed."""
    if training.fp8_format is None:
        return
    if not has_fp8_matmuls(device_type) and not emulated():
        raise ConfigError(
            f"{flag.fp8_format} {training.fp8_format}: this device ({device_type}) has no fp8 matmuls, and paratron "
            "has no fp8 training without them (CUDA compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
            "train in --bf16"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"{flag.fp8_format} {training.fp8_format}: fp8 training runs through torchao's float8 layers, which "
            "are not installed: pip install torchao (or train in --bf16)"
        )


def fp8_layer(module: nn.Module, name: str) -> bool:
    """Which layers run in fp8: the plain `nn.Linear`s of the language model's transformer layers whose sides
    fp8 matmuls take (not the output layer, a vision encoder, LoRA's or a pipeline schedule's own linears)."""
    if type(module) is not nn.Linear or not name.startswith("layers."):
        return False
    return module.in_features % FP8_DIVISOR == 0 and module.out_features % FP8_DIVISOR == 0


EMULATE_VARIABLE = "PARATRON_FP8_EMULATE"
"""Test switch (not a user setting): when set to 1, `check_fp8` lets any device through and the fp8 layers
emulate their matmuls in high precision (torchao's `emulate`: the same fp8 casts and scales, no fp8 kernel),
so the conversion, its casts and its layouts are exercised by tests on the CPU. Slow; never for training."""


def emulated() -> bool:
    return os.environ.get(EMULATE_VARIABLE) == "1"


def cast_targets(fp8_format: str) -> dict[str, torch.dtype]:
    """The fp8 type of each of torchao's casts under Megatron's format names: e4m3 everywhere, or hybrid
    (e4m3 for inputs and weights, e5m2's wider range for the output gradients, both of their uses)."""
    gradient = torch.float8_e5m2 if fp8_format == "hybrid" else torch.float8_e4m3fn
    return {
        "cast_config_input": torch.float8_e4m3fn,
        "cast_config_input_for_grad_weight": torch.float8_e4m3fn,
        "cast_config_weight": torch.float8_e4m3fn,
        "cast_config_weight_for_grad_input": torch.float8_e4m3fn,
        "cast_config_grad_output": gradient,
        "cast_config_grad_output_for_grad_weight": gradient,
    }


def float8_config(fp8_format: str, fp8_recipe: str, param_gather: bool = False) -> object:
    """torchao's `Float8LinearConfig` for a format and recipe: the recipe's scaling (one scale per tensor, or
    per row), with each cast's fp8 type set by the format (torchao's tensorwise recipe alone would cast the
    gradients to e5m2, its rowwise one to e4m3, whatever the format asked). `param_gather`: FSDP2 gathers the
    weights in fp8 (--fp8-param-gather)."""
    float8 = importlib.import_module("torchao.float8")  # (an optional dependency, loaded only when asked for)
    config = float8.Float8LinearConfig.from_recipe_name(fp8_recipe)
    casts = {
        name: dataclasses.replace(getattr(config, name), target_dtype=dtype)
        for name, dtype in cast_targets(fp8_format).items()
    }
    return dataclasses.replace(config, **casts, emulate=emulated(), enable_fsdp_float8_all_gather=param_gather)


@torch.no_grad()
def precompute_weight_scales(model: nn.Module) -> None:
    """Under --fp8-param-gather: the scale of every fp8 weight for the all-gathers to come, from one all-reduce
    of all their amaxes (torchao's precompute for FSDP2), instead of one all-reduce per weight inside each
    gather. Run before each step's (and evaluation's) first gather, so it always sees the current weights."""
    importlib.import_module("torchao.float8").precompute_float8_dynamic_scale_for_fsdp(model)


def convert_to_float8(model: nn.Module, training: TrainingConfig) -> nn.Module:
    """Swap `model`'s fp8 layers for torchao's Float8Linear, and retype its tensor-parallel fp8 layers into
    their fp8 twins, in place (on the meta device too, before the weights are allocated). `check_fp8` has
    passed: the device has fp8 matmuls (or they are emulated) and torchao is installed."""
    float8 = importlib.import_module("torchao.float8")
    config = float8_config(training.fp8_format or "", training.fp8_recipe, training.fp8_param_gather)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=fp8_layer)
    grouped = {id(layer) for m in model.modules() if isinstance(m, ColumnParallelProjections) for layer in m.values()}
    tensor_parallel = [
        module
        for name, module in model.named_modules()
        if id(module) not in grouped and _tensor_parallel_fp8(module, name)
    ]
    if tensor_parallel:
        matmul = _float8_matmul(config)
        for module in tensor_parallel:
            for layer in module.values() if isinstance(module, ColumnParallelProjections) else [module]:
                retype(layer, matmul)
            if isinstance(module, ColumnParallelProjections):
                retype(module)
    return model


def _tensor_parallel_fp8(module: nn.Module, name: str) -> bool:
    """Which tensor-parallel layers run in fp8: those of the transformer layers without a LoRA adapter whose
    shards fp8 matmuls take (a projections group only whole); not the vocabulary-parallel output layer."""
    if not name.startswith("layers.") or type(module) not in FP8_TWINS:
        return False
    layers = list(module.values()) if isinstance(module, ColumnParallelProjections) else [module]
    return all(layer.lora_a is None and all(side % FP8_DIVISOR == 0 for side in layer.weight.shape) for layer in layers)


def _float8_matmul(config: object) -> Float8Matmul:
    """x W^T through torchao's fp8 matmul (casts and scaled matmuls, forward and backward) under `config`, as
    its Float8Linear runs it."""
    linear = importlib.import_module("torchao.float8.float8_linear")
    mm_config = linear.Float8Linear(FP8_DIVISOR, FP8_DIVISOR, bias=False, config=config, device="meta").linear_mm_config

    def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear.matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)

    return matmul
