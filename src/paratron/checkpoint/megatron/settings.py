"""Megatron-LM's args <-> paratron's model settings: what a checkpoint's saved args say of its model
(refused in one line where paratron's layers differ), Megatron's padded vocabulary, and the args a
written checkpoint records.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import torch

from paratron.checkpoint.converted import config_from_settings
from paratron.checkpoint.megatron.tensor_layout import Shapes
from paratron.config.schema import Config, ModelConfig
from paratron.errors import CheckpointError


def model_settings(args: dict[str, Any], source: str = "args") -> dict[str, Any]:
    """paratron model settings for Megatron-LM `args` (refused with one line where paratron's
    layers differ)."""
    extra = _carried_settings(args, source)
    settings = _layer_settings(args)
    if settings["position_embedding_type"] == "rope":
        settings["rotary_base"] = float(args.get("rotary_base", 10000))
        settings.update(extra)
    else:
        settings.update({k: v for k, v in extra.items() if k == "apply_layernorm_1p"})
    return settings


def _refusal(source: str, what: str) -> CheckpointError:
    return CheckpointError(f"{source}: {what} is not supported by paratron's GPT layers")


def _carried_settings(args: dict[str, Any], source: str) -> dict[str, Any]:
    """The settings of `args` that paratron's model has too, carried over as they are; raises the
    one-line refusal of the first thing in `args` that paratron's layers do not have."""
    if args.get("num_experts"):
        raise _refusal(source, "a mixture of experts (--num-experts)")
    optional = {f.name for f in dataclasses.fields(ModelConfig)}
    extra = {}
    for name, default in (("apply_layernorm_1p", False), ("rotary_interleaved", False), ("rotary_percent", 1.0)):
        value = args.get(name, default)
        if name in optional:  # (paratron has the setting: carried over as it is)
            extra[name] = type(default)(value)
        elif value != default:
            raise _refusal(source, f"--{name.replace('_', '-')} {value}")
    if args.get("use_rope_scaling"):
        raise _refusal(source, "--use-rope-scaling")
    if args.get("multi_latent_attention"):
        raise _refusal(source, "multi-latent attention")
    if args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern"):
        raise _refusal(source, "a hybrid layer stack (--hybrid-layer-pattern)")
    if args.get("attention_output_gate"):
        raise _refusal(source, "--attention-output-gate")
    if args.get("squared_relu") and args.get("swiglu"):
        raise _refusal(source, "--squared-relu with --swiglu (two MLP activations)")
    position = args.get("position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope", "none"):
        raise _refusal(source, f"--position-embedding-type {position}")
    normalization = args.get("normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise _refusal(source, f"--normalization {normalization}")
    return extra


def _layer_settings(args: dict[str, Any]) -> dict[str, Any]:
    """The shapes and switches of the layers `args` describe, under paratron's names (with Megatron-LM's
    defaults for what the args leave out)."""
    heads, hidden = int(args["num_attention_heads"]), int(args["hidden_size"])
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    kv = args.get("kv_channels")
    return dict(
        num_layers=int(args["num_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(args.get("ffn_hidden_size") or 4 * hidden),
        num_attention_heads=heads,
        num_query_groups=int(groups or heads),
        kv_channels=int(kv) if kv and int(kv) * heads != hidden else None,
        max_position_embeddings=int(args.get("max_position_embeddings") or args.get("seq_length") or 1024),
        vocab_size=vocab_size_of(args),
        position_embedding_type=args.get("position_embedding_type", "learned_absolute"),
        normalization=args.get("normalization", "LayerNorm"),
        norm_epsilon=float(args.get("norm_epsilon", 1e-5)),
        activation="swiglu" if args.get("swiglu") else "squared_relu" if args.get("squared_relu") else "gelu",
        openai_gelu=bool(args.get("openai_gelu", False)),
        add_bias_linear=bool(args.get("add_bias_linear", True)),
        add_qkv_bias=bool(args.get("add_qkv_bias", False)),
        qk_layernorm=bool(args.get("qk_layernorm", False)),
        untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights", False)),
        hidden_dropout=float(args.get("hidden_dropout", 0.1)),
        attention_dropout=float(args.get("attention_dropout", 0.1)),
        init_method_std=float(args.get("init_method_std", 0.02)),
        make_vocab_size_divisible_by=int(args.get("make_vocab_size_divisible_by", 128)),
    )


def vocab_size_of(args: dict[str, Any]) -> int:
    """The real vocabulary: `vocab_size` when the args record it (the tokenizer's), else the padded one."""
    return int(args.get("vocab_size") or args["padded_vocab_size"])


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padded vocabulary: a multiple of make_vocab_size_divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def config_of(args: dict[str, Any], source: str) -> Config:
    """The paratron configuration of Megatron-LM `args` (refused in one line naming `source`)."""
    return config_from_settings(model_settings(args, source))


def megatron_args(config: Config, tp: int, pp: int, padded: int, iteration: int, consumed: int) -> argparse.Namespace:
    """The `args` Namespace of a written checkpoint: the model's architecture and the layout."""
    m = config.model
    for setting, used in (
        ("--hybrid-layer-pattern", m.hybrid_layer_pattern),
        ("--attention-output-gate", m.attention_output_gate),
        ("--multi-latent-attention", m.multi_latent_attention),
    ):
        if used:  # (Megatron-LM's GPT checkpoints hold Transformer blocks: the layer names differ)
            raise CheckpointError(
                f"{setting}: Megatron-LM checkpoints are written for Transformer blocks; keep this model as a "
                "paratron checkpoint"
            )
    heads = m.num_attention_heads
    groups = Shapes.of(m).groups
    extra = {name: getattr(m, name, None) for name in ("apply_layernorm_1p", "rotary_percent", "rotary_interleaved")}
    return argparse.Namespace(
        **{name: value for name, value in extra.items() if value is not None},
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=m.kv_channels,
        max_position_embeddings=m.max_position_embeddings,
        seq_length=config.data.seq_length,
        vocab_size=m.vocab_size,
        padded_vocab_size=padded,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        rotary_base=int(m.rotary_base) if float(m.rotary_base).is_integer() else m.rotary_base,
        normalization=m.normalization,
        norm_epsilon=m.norm_epsilon,
        swiglu=m.activation == "swiglu",
        squared_relu=m.activation == "squared_relu",
        openai_gelu=m.openai_gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        num_experts=None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        transformer_impl="local",
        ckpt_format="torch",
        use_dist_ckpt=False,
        iteration=iteration,
        consumed_train_samples=consumed,
        consumed_valid_samples=0,
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
    )
