"""What a Hugging Face `config.json` means by the fields it leaves out, per model type.

transformers fills every field a `config.json` leaves out with its config class's default
(`LlamaConfig().max_position_embeddings` is 2048, `MistralConfig().sliding_window` 4096, ...), so a
short file still describes one model; `save_pretrained` of older releases wrote only the fields that
differ from those defaults. These tables hold transformers' defaults for the fields paratron reads,
so that a short file is read as transformers reads it (transformers itself is not needed to convert).
A `None` default is derived from other fields, as transformers derives it: `num_key_value_heads`
from `num_attention_heads`, `head_dim` from `hidden_size / num_attention_heads` (Qwen2, Qwen2-MoE
and Qwen3-MoE have no such field, but their layers read one when the file gives it), GPT-2's
`n_inner` from `4 * n_embd`. `rope_theta` is the default base of plain rotary
embeddings (transformers' `default_theta`), used when neither `rope_parameters`, `rope_scaling`
nor a top-level `rope_theta` gives one.
"""

from __future__ import annotations

import json
from typing import Any

_LLAMA = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=None,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    attention_bias=False,
    mlp_bias=False,
    attention_dropout=0.0,
)
_MISTRAL = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    sliding_window=4096,
    attention_dropout=0.0,
)
_QWEN2 = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    layer_types=None,
    attention_dropout=0.0,
)
_QWEN3 = dict(_QWEN2, head_dim=128, attention_bias=False)
_GPT2 = dict(
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    resid_pdrop=0.1,
    attn_pdrop=0.1,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=True,
)
_MIXTRAL = dict(
    _MISTRAL,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    sliding_window=None,
    num_local_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.001,
)
_QWEN2_MOE = dict(
    _QWEN2,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    decoder_sparse_step=1,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
    num_experts_per_tok=4,
    num_experts=60,
    norm_topk_prob=False,
    router_aux_loss_coef=0.001,
    mlp_only_layers=[],
    qkv_bias=True,
)
_QWEN3_MOE = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    attention_bias=False,
    use_sliding_window=False,
    sliding_window=4096,
    attention_dropout=0.0,
    decoder_sparse_step=1,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    num_local_experts=128,
    norm_topk_prob=False,
    router_aux_loss_coef=0.001,
    mlp_only_layers=[],
)

_LLAVA = dict(
    image_token_index=32000,
    image_seq_length=576,
    projector_hidden_act="gelu",
    vision_feature_select_strategy="default",
    multimodal_projector_bias=True,
    tie_word_embeddings=False,
)
_CLIP_VISION = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_channels=3,
    image_size=224,
    patch_size=32,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)
_SIGLIP_VISION = dict(
    _CLIP_VISION, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=True
)

DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "mistral": _MISTRAL,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "gpt2": _GPT2,
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN2_MOE,
    "qwen3_moe": _QWEN3_MOE,
    "llava": _LLAVA,
    "clip_vision_model": _CLIP_VISION,
    "siglip_vision_model": _SIGLIP_VISION,
}
"""transformers' default of each field paratron reads, per `model_type` (transformers 5's config classes; a
vision-language model's `text_config` and `vision_config` are read by the tables of their own model types)."""

LLAVA_VISION_CONFIG = dict(
    model_type="clip_vision_model",
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=336,
    patch_size=14,
)
"""The vision tower LlavaConfig builds when config.json has no `vision_config` (LLaVA-1.5's CLIP ViT-L/14-336)."""

ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "llava": {"image_token_id": "image_token_index"},
}
"""Second names transformers accepts for a field (its config classes' `attribute_map`), per model type."""


WEIGHT_SHAPING = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "qkv_bias",
        "n_positions",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "image_size",
        "patch_size",
        "vision_use_head",
    }
)
"""Fields that fix the weights' names and shapes (and the head and expert counts): a default of one of
them that does not suit the model shows as weights that do not fit, and the message names the field."""

DERIVED = {
    "num_key_value_heads": "num_attention_heads",
    "head_dim": "hidden_size / num_attention_heads",
    "n_inner": "4 * n_embd",
}
"""What a `None` default is derived from."""
_OPTIONAL_TYPES = {"num_key_value_heads": int, "head_dim": int, "n_inner": int, "layer_types": list}
"""The type of a field whose default is `None`, when the file gives it."""
_NULLABLE = ("sliding_window", "mlp_only_layers")
"""Fields with a default that transformers also takes as null (no window; no dense layers)."""


def default_text(kind: str, name: str) -> str:
    """transformers' default of field `name` for model type `kind`, as `name=value` for a message."""
    value = DEFAULTS[kind][name]
    return f"{name}={DERIVED[name] if value is None and name in DERIVED else json.dumps(value)}"


def spelled(kind: str, name: str) -> str:
    """Field `name` of model type `kind` with its second name, if it has one, for a message."""
    others = [alias for alias, field in ALIASES.get(kind, {}).items() if field == name]
    return f"{name} (or {', '.join(others)})" if others else name


_KINDS_OF_VALUE = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", list: "a list"}


def first_wrong_type(hf: dict[str, Any], kind: str) -> tuple[str, str] | None:
    """The first field of `hf` (a `config.json` of model type `kind`) whose value is not of the type
    transformers declares, and what it must be (None when every field paratron reads is right)."""
    for name, value in hf.items():
        field = ALIASES.get(kind, {}).get(name, name)
        if field in DEFAULTS[kind]:
            wanted = _wrong_type(kind, field, value)
            if wanted:
                return name, wanted
    return None


def _wrong_type(kind: str, name: str, value: Any) -> str | None:
    """What field `name` (of the table of model type `kind`) must be, when `value` is not that."""
    default = DEFAULTS[kind][name]
    if value is None and (default is None or name in _NULLABLE):
        return None
    wanted = int if name == "sliding_window" else _OPTIONAL_TYPES.get(name, type(default))
    numeric = (int, float) if wanted is float else wanted
    if isinstance(value, numeric) and (wanted is bool or not isinstance(value, bool)):
        return None
    return _KINDS_OF_VALUE[wanted]


def with_defaults(hf: dict[str, Any], kind: str) -> tuple[dict[str, Any], list[str]]:
    """`hf` (a `config.json` of model type `kind`) with transformers' default in every field it
    leaves out, and the names of those fields (in the table's order)."""
    given = dict(hf)
    for alias, name in ALIASES.get(kind, {}).items():
        if given.get(name) is None and given.get(alias) is not None:
            given[name] = given[alias]
    rope = given.get("rope_scaling") or given.get("rope_parameters") or {}
    has_theta = isinstance(rope, dict) and rope.get("rope_theta") is not None
    missing = [name for name in DEFAULTS[kind] if name not in given and not (name == "rope_theta" and has_theta)]
    return {**DEFAULTS[kind], **given}, missing
