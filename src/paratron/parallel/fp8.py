"""fp8 training of the linear layers through torchao's float8 training (--fp8-format, --fp8-recipe).

paratron does not implement fp8 matmuls itself: where the device has them (CUDA compute capability 8.9 and
newer) and torchao is installed, `convert_to_float8` swaps the transformer layers' `nn.Linear`s for torchao's
`Float8Linear` (scaled fp8 matmuls forward and backward, bf16 weights and optimizer state kept). The output
layer stays in bf16, as in Megatron-LM. `check_fp8` refuses every other case in one line before training.
The conversion itself runs only on such a device with torchao present: the CPU tests reach the refusals only.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util

import torch
from torch import nn

from paratron.config.fields import flag
from paratron.config.schema import TrainingConfig
from paratron.distributed.init import has_fp8_matmuls
from paratron.errors import ConfigError

FP8_DIVISOR = 16
"""fp8 matmuls need both sides of a weight to be multiples of this."""


def check_fp8(training: TrainingConfig, device_type: str) -> None:
    """With --fp8-format: a ConfigError (one line) where the device (a type: cuda, cpu, ...) has no fp8
    matmuls, or where torchao, which paratron's fp8 training runs through, is not installed."""
    if training.fp8_format is None:
        return
    if not has_fp8_matmuls(device_type):
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


def convert_to_float8(model: nn.Module, fp8_format: str, fp8_recipe: str) -> nn.Module:
    """Swap `model`'s fp8 layers for torchao's Float8Linear, in place (on the meta device too, before the
    weights are allocated). `check_fp8` has passed: the device has fp8 matmuls and torchao is installed.
    Not exercised by paratron's tests, which run without either."""
    float8 = importlib.import_module("torchao.float8")  # (an optional dependency, loaded only when asked for)
    config = float8.Float8LinearConfig.from_recipe_name(fp8_recipe)
    if fp8_format == "hybrid":  # (e5m2's wider range for the gradients, e4m3 forward)
        grad = dataclasses.replace(config.cast_config_grad_output, target_dtype=torch.float8_e5m2)
        config = dataclasses.replace(config, cast_config_grad_output=grad)
    return float8.convert_to_float8_training(model, config=config, module_filter_fn=fp8_layer)
