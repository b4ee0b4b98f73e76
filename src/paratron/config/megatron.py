"""Megatron-LM compatibility: flag spellings that differ from our field names, and the
Megatron flags paratron knows but does not support yet (refused by name, never ignored).

Most shared settings need no entry here: field names already are Megatron's argument
names (`--hidden-size` is `hidden_size`).
"""

from __future__ import annotations

from typing import Any

from paratron.config.fields import all_fields
from paratron.errors import ConfigError

SWITCHES: dict[str, tuple[str, Any, str]] = {
    # flag name -> (field it sets, value, help)
    "fp16": ("precision", "fp16", "Train in fp16 mixed precision with dynamic loss scaling (sets --precision fp16)."),
    "bf16": ("precision", "bf16", "Train in bf16 mixed precision (sets --precision bf16)."),
    "swiglu": ("activation", "swiglu", "Use the SwiGLU MLP (sets --activation swiglu)."),
    "disable_bias_linear": ("add_bias_linear", False, "Linear layers without biases (sets --no-add-bias-linear)."),
    "recompute_activations": (
        "recompute_granularity",
        "selective",
        "Recompute the attention core in backward (sets --recompute-granularity selective).",
    ),
    "group_query_attention": (
        "num_query_groups",
        None,
        "Accepted for Megatron-LM scripts: grouped-query attention follows from --num-query-groups.",
    ),
}
"""Flags that take no value and set a field to a constant."""

RENAMES: dict[str, str] = {
    "nproc": "nproc_per_node",
    "model": "model_name",
}
"""Other spellings of a field's name."""

UNSUPPORTED: frozenset[str] = frozenset(
    """
    pipeline-model-parallel-split-rank
    accumulate-allreduce-grads-in-fp32
    distribute-saved-activations fp8-format fp8 use-flash-attn transformer-impl attention-backend
    ckpt-format use-dist-ckpt
    no-load-rng auto-detect-ckpt-format tensorboard-dir wandb-project
    lr-warmup-fraction lr-warmup-samples lr-decay-samples train-samples rampup-batch-size
    rotary-percent rotary-interleaved apply-query-key-layer-scaling attention-softmax-in-fp32
    tp-comm-overlap no-masked-softmax-fusion no-bias-gelu-fusion no-bias-dropout-fusion
    no-gradient-accumulation-fusion cross-entropy-loss-fusion
    num-workers dataloader-type
    profile
    overlap-p2p-communication empty-unused-memory-level check-for-nan-in-loss-and-grad manual-gc
    use-cpu-initialization data-parallel-random-init log-params-norm log-num-zeros-in-grad
    timing-log-level log-timers-to-tensorboard spec use-mcore-models use-legacy-models
    """.split()
)
"""Megatron-LM flags a user may bring that paratron does not implement yet."""


def unsupported_flag_message(flag: str) -> str:
    return f"{flag} is a Megatron-LM flag that paratron does not support yet; remove it from the command line"


def from_megatron_dict(args: dict[str, Any]) -> dict[str, Any]:
    """Turn the dict form of Megatron tutorials ({'tensor_model_parallel_size': 2, 'use_fp16': True, ...})
    into field overrides."""
    fields = all_fields()
    out: dict[str, Any] = {}
    for key, value in args.items():
        name = key.replace("-", "_")
        if name in ("use_fp16", "use_bf16", "fp16", "bf16"):
            if value:
                out["precision"] = "fp16" if "fp16" in name else "bf16"
        elif name in SWITCHES:
            field_name, constant, _ = SWITCHES[name]
            if value and constant is not None:
                out[field_name] = constant
        elif name in RENAMES:
            out[RENAMES[name]] = value
        elif name in fields:
            out[name] = value
        elif name.replace("_", "-") in UNSUPPORTED:
            raise ConfigError(f"{key}: a Megatron-LM setting that paratron does not support yet; remove it")
        else:
            raise ConfigError(f"{key}: unknown setting; `paratron train --help` lists them all")
    return out
