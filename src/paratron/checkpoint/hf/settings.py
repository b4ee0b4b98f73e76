"""Hugging Face config.json <-> paratron model settings, for every family of `families.FAMILIES`.

config.json is read as transformers reads it: a field the file leaves out takes transformers' default
for its model type (the tables of `hf_defaults`). A model paratron's layers cannot express, either way,
is refused in one line.
"""

from __future__ import annotations

import json
from typing import Any

from paratron.checkpoint.hf import llava
from paratron.checkpoint.hf.families import ARCHITECTURES, FAMILIES
from paratron.checkpoint.hf.family import Family
from paratron.checkpoint.hf_defaults import first_wrong_type, with_defaults
from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError


def model_settings(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """paratron model settings for a Hugging Face `config.json` (refused with one line when the
    model has something paratron's layers do not). A field the file leaves out takes transformers'
    default for the model type (`hf_defaults.DEFAULTS`), as transformers itself reads the file."""
    family = family_of(hf, source)
    wrong = first_wrong_type(hf, family.model_type)
    if wrong:
        raise CheckpointError(f"{source}: {wrong[0]} is {json.dumps(hf[wrong[0]])}, not {wrong[1]}; correct it")
    hf, _ = with_defaults(hf, family.model_type)
    settings = family.read_settings(hf, family, source)
    if family.text_families:  # (a vision-language model: its language model is a text family's)
        language = model_settings(llava.text_config(hf, family, source), f"{source} (text_config)")
        return llava.with_language(language, settings, source)
    return settings


def family_of(hf: dict[str, Any], source: str) -> Family:
    """The supported family a config.json declares (its `architectures` only hint at a missing model_type)."""
    if "model_type" not in hf:
        by_class = {architecture: kind for kind, architecture in ARCHITECTURES.items()}
        named = [by_class[a] for a in hf.get("architectures") or [] if isinstance(a, str) and a in by_class]
        hint = f'"model_type": "{named[0]}" (its architectures say {ARCHITECTURES[named[0]]})' if named else "it"
        raise CheckpointError(f"{source}: has no model_type (one of {', '.join(ARCHITECTURES)}); add {hint}")
    kind = hf["model_type"]
    if kind not in FAMILIES:
        classes = [a for a in hf.get("architectures") or [] if isinstance(a, str)]
        named = f" ({classes[0]})" if classes else ""
        if "vision_config" in hf or any(a.endswith("ForConditionalGeneration") for a in classes):
            raise CheckpointError(
                f"{source}: model_type {kind!r}{named} is a vision-language design paratron does not convert; "
                f"of those it converts LLaVA's {ARCHITECTURES['llava']} (model_type llava)"
            )
        raise CheckpointError(
            f"{source}: model_type {kind!r} is not supported; convert one of {', '.join(ARCHITECTURES)}"
        )
    return FAMILIES[kind]


def hf_config(m: ModelConfig, kind: str) -> dict[str, Any]:
    """A Hugging Face `config.json` for paratron model `m` as architecture `kind`."""
    _refuse_squared_relu(m)
    _refuse_layer_kinds(m)
    family = FAMILIES[kind]
    if family.text_families:  # (a vision-language model: its language model's config.json nested)
        language = {k: v for k, v in hf_config(m, _language_type_of(m)).items() if k not in _TOP_LEVEL_ONLY}
        written = {"architectures": [family.architecture], "model_type": kind, "text_config": language}
        return {**written, **family.write_config(m, family), "torch_dtype": "float32"}
    common = {
        "architectures": [family.architecture],
        "model_type": kind,
        "vocab_size": m.vocab_size,
        "torch_dtype": "float32",
        **_window_config(m, family),  # (and refused when the architecture has no such attention)
    }
    return {**common, **family.write_config(m, family)}


_TOP_LEVEL_ONLY = ("architectures", "torch_dtype")
"""Entries of a text family's config.json that a vision-language config.json holds at its top level only."""


def _window_config(m: ModelConfig, family: Family) -> dict[str, Any]:
    """The sliding-window entries of a `config.json` for model `m` in `family`."""
    if m.attention_type == "block-sparse" or (family.write_windows is None and m.attention_type == "sliding-window"):
        raise CheckpointError(
            f"--attention-type {m.attention_type} has no equivalent in Hugging Face's {family.architecture}; "
            "export a model trained with causal or sliding-window attention"
        )
    if family.write_windows is None:
        return {}
    window = m.window_size if m.attention_type == "sliding-window" else None
    return family.write_windows(window, m.num_layers)


def _refuse_megatron_only_features(m: ModelConfig) -> None:
    """Megatron-LM model settings that none of the supported Hugging Face architectures can express."""
    unsupported = {
        "--apply-layernorm-1p (norm scales stored as w, applied as 1 + w)": m.apply_layernorm_1p,
        "--rotary-percent below 1 (partial rotary embeddings)": m.rotary_percent < 1.0,
        "--rotary-interleaved (rotation of interleaved feature pairs)": m.rotary_interleaved,
        "--position-embedding-type none (no position embeddings)": m.position_embedding_type == "none",
        "--moe-router-num-groups (group-limited expert routing)": m.moe_router_num_groups is not None,
    }
    _refuse_squared_relu(m)
    for setting, used in unsupported.items():
        if used:
            raise CheckpointError(
                f"this model uses {setting}, which the Hugging Face Llama/Qwen/Mistral/GPT-2 formats cannot express; "
                "keep it as a paratron checkpoint"
            )


def _refuse_layer_kinds(m: ModelConfig) -> None:
    """A layer pattern, the gated attention and multi-latent attention: layers none of the converted families has."""
    for setting, used in (
        ("--hybrid-layer-pattern (layers given one sublayer at a time)", m.hybrid_layer_pattern),
        ("--attention-output-gate (gated attention outputs)", m.attention_output_gate),
        ("--multi-latent-attention (DeepSeek's attention through latents)", m.multi_latent_attention),
    ):
        if used:
            raise CheckpointError(
                f"this model uses {setting}, which the Hugging Face families paratron converts cannot express; "
                "keep it as a paratron checkpoint"
            )


def _refuse_squared_relu(m: ModelConfig) -> None:
    """Squared ReLU is Nemotron's MLP (hidden_act relu2), a family paratron does not convert."""
    if m.activation == "squared_relu":
        raise CheckpointError(
            "this model uses --squared-relu (relu(x)^2, Hugging Face's hidden_act relu2 of Nemotron), and paratron "
            "converts no Hugging Face family with it; keep it as a paratron or Megatron-LM checkpoint"
        )


def model_type_of(m: ModelConfig, preferred: str | None = None) -> str:
    """The Hugging Face architecture that has exactly paratron model `m`'s layers (LLaVA's for a vision-language
    model; `preferred`, the family the model came from, settles a tie between Llama and Mistral)."""
    if not m.has_vision:
        return _language_type_of(m, preferred)
    llava.refuse_unexportable(m)
    language = _language_type_of(m)
    if language not in FAMILIES["llava"].text_families:
        raise CheckpointError(
            f"a vision-language model's language model must be Llama, Mistral or Qwen2 for Hugging Face's "
            f"{ARCHITECTURES['llava']}, and this one is {FAMILIES[language].name}; keep it as a paratron checkpoint"
        )
    return "llava"


def _language_type_of(m: ModelConfig, preferred: str | None = None) -> str:
    """The Hugging Face text family that has exactly paratron model `m`'s language model."""
    _refuse_megatron_only_features(m)
    if (
        m.position_embedding_type == "rope"
        and m.normalization == "RMSNorm"
        and m.activation == "swiglu"
        and not m.add_bias_linear
    ):
        if m.num_experts:
            return _moe_type_of(m)
        if m.qk_layernorm and not m.add_qkv_bias:
            return "qwen3"
        if m.add_qkv_bias and not m.qk_layernorm:
            return "qwen2"
        if m.qk_layernorm:
            raise CheckpointError("no Hugging Face model has both query/key/value biases and query/key norms")
        if m.attention_type == "sliding-window":
            return "mistral"  # (Llama has no window)
        return preferred if preferred in ("llama", "mistral") else "llama"
    if (
        m.position_embedding_type == "learned_absolute"
        and m.normalization == "LayerNorm"
        and m.activation == "gelu"
        and m.add_bias_linear
        and not m.untie_embeddings_and_output_weights
    ):
        return "gpt2"
    raise CheckpointError(
        "this model has no Hugging Face equivalent (Llama, Mistral and Qwen2 need rotary "
        "embeddings, RMSNorm, SwiGLU and no linear biases; GPT-2 needs learned positions, "
        "LayerNorm, GELU, biases and tied embeddings)"
    )


def _moe_type_of(m: ModelConfig) -> str:
    for setting, used in (
        ("--moe-router-topk-scaling-factor (routed scaling)", m.moe_router_topk_scaling_factor is not None),
        ("--moe-router-enable-expert-bias (aux-loss-free expert bias)", m.moe_router_enable_expert_bias),
    ):
        if used:  # (Mixtral, Qwen2-MoE and Qwen3-MoE route without either: exported, the model would change)
            raise CheckpointError(
                f"this model uses {setting}, which the Hugging Face Mixtral/Qwen2-MoE/Qwen3-MoE formats cannot "
                "express; keep it as a paratron checkpoint"
            )
    softmax = m.moe_router_score_function == "softmax"
    shared = m.moe_shared_expert_intermediate_size
    mixtral = not (m.add_qkv_bias or m.qk_layernorm or shared or m.moe_router_pre_softmax)
    if mixtral and all(m.moe_layer_pattern) and softmax:
        return "mixtral"
    shared_ok = bool(shared) == m.moe_shared_expert_gate
    if m.add_qkv_bias and not m.qk_layernorm and shared_ok and softmax:
        return "qwen2_moe"
    if m.qk_layernorm and not m.add_qkv_bias and not shared and softmax:
        return "qwen3_moe"
    raise CheckpointError(
        "this mixture of experts has no Hugging Face equivalent (Mixtral: softmax over the top-k, every layer MoE, "
        "no shared expert; Qwen2-MoE: query/key/value biases, a shared expert with its gate or none; Qwen3-MoE: "
        "query/key norms, no shared expert)"
    )
