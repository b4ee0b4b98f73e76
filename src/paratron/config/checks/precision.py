"""Number formats: fp16's loss scale, bf16 gradients, fp8 matmuls (what the settings alone can tell)."""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.layout import Layout
from paratron.config.schema import Config, TrainingConfig
from paratron.errors import ConfigError


def check_precision(t: TrainingConfig) -> None:
    """The loss scale settings belong to fp16 and agree with each other."""
    if t.loss_scale is not None and t.precision != "fp16":
        raise ConfigError(
            f"{flag.loss_scale} applies to fp16 training only (this run is {t.precision}); add --fp16 or drop it"
        )
    if t.min_loss_scale > t.initial_loss_scale:
        raise ConfigError(
            f"{flag.min_loss_scale} {t.min_loss_scale:g} exceeds {flag.initial_loss_scale} "
            f"{t.initial_loss_scale:g}; lower the first or raise the second"
        )


def check_gradient_precision(config: Config) -> None:
    """bf16 gradients go with bf16 weights only (Megatron-LM reads the flag only with --bf16): fp16 training scales
    the loss so that small gradients keep fp16's 10 mantissa bits, which bf16's 7 would throw away, and fp32 training
    keeps everything in fp32."""
    precision = config.training.precision
    if config.parallel.grad_reduce_in_bf16 and precision != "bf16":
        raise ConfigError(
            f"{flag.grad_reduce_in_bf16} keeps gradients in bf16 next to bf16 weights, but this run is {precision} "
            f"(fp16 and fp32 runs accumulate and reduce gradients in fp32): add --bf16 or drop "
            f"{flag.grad_reduce_in_bf16}"
        )


def check_fp8_settings(config: Config, layout: Layout) -> None:
    """fp8 matmuls run inside bf16 training; fp8 weight gathers need ZeRO-3, one scale per weight and no tensor
    parallelism. Whether the device has fp8 matmuls is asked later, of the device (parallel/fp8.py)."""
    t = config.training
    if t.fp8_format is None:
        if t.fp8_param_gather:
            raise ConfigError(f"{flag.fp8_param_gather} gathers fp8 weights; add {flag.fp8_format} e4m3 or hybrid")
        return
    if t.precision != "bf16":
        raise ConfigError(
            f"{flag.fp8_format} {t.fp8_format} runs inside bf16 training (this run is {t.precision}); add --bf16"
        )
    if t.fp8_param_gather and layout.tp > 1:
        tp = flag.tensor_model_parallel_size
        raise ConfigError(
            f"{flag.fp8_param_gather} with {tp} {layout.tp}: the tensor-parallel fp8 layers gather their weights "
            f"in bf16; drop {flag.fp8_param_gather} or use {tp} 1"
        )
    if t.fp8_param_gather and config.parallel.zero_stage != 3:
        raise ConfigError(
            f"{flag.fp8_param_gather} gathers ZeRO-3's weight shards in fp8, and this run is "
            f"{flag.zero_stage} {config.parallel.zero_stage}; add {flag.zero_stage} 3 or drop {flag.fp8_param_gather}"
        )
    if t.fp8_param_gather and t.fp8_recipe != "tensorwise":
        raise ConfigError(
            f"{flag.fp8_param_gather} needs one scale per weight ({flag.fp8_recipe} tensorwise), not "
            f"{flag.fp8_recipe} {t.fp8_recipe}; change one of the two"
        )
