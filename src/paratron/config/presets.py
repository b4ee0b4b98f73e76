"""Named model sizes (`--model NAME`). Each entry holds only the settings that differ from
ModelConfig's defaults (no dropout is added to all); they sit between the defaults and the recipe
in precedence."""

from __future__ import annotations

from typing import Any

from paratron.errors import ConfigError

_GPT2 = dict(
    position_embedding_type="learned_absolute",
    normalization="LayerNorm",
    activation="gelu",
    openai_gelu=True,
    add_bias_linear=True,
    vocab_size=50257,
    max_position_embeddings=1024,
)
_LLAMA3 = dict(
    position_embedding_type="rope",
    rotary_base=500000.0,
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    vocab_size=128256,
    num_query_groups=8,
    max_position_embeddings=8192,
)

_DEEPSEEK = dict(  # DeepSeek-V2/V3's multi-latent attention with YaRN, SwiGLU, RMSNorm, no biases, untied
    position_embedding_type="rope",
    rotary_base=10000.0,
    normalization="RMSNorm",
    norm_epsilon=1e-6,
    activation="swiglu",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    max_position_embeddings=163840,
    multi_latent_attention=True,
    qk_layernorm=True,  # (the latents' norms)
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    rope_type="yarn",
    rotary_scaling_factor=40.0,
    original_max_position_embeddings=4096,
    mscale=1.0,
    mscale_all_dim=1.0,
)

_DEEPSEEK_V3 = dict(  # DeepSeek-V3's shape (Kimi-K2 keeps it): 61 layers of width 7168, query latent 1536, sigmoid
    # routing with expert bias over experts of 2048 and one shared expert of the same width
    _DEEPSEEK,
    num_layers=61,
    hidden_size=7168,
    ffn_hidden_size=18432,
    q_lora_rank=1536,
    moe_router_topk=8,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_ffn_hidden_size=2048,
    moe_shared_expert_intermediate_size=2048,
)

MODELS: dict[str, dict[str, Any]] = {
    "debug": dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, max_position_embeddings=256
    ),
    "gpt2-small": dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12),
    "gpt2-medium": dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16),
    "gpt2-xl": dict(_GPT2, num_layers=48, hidden_size=1600, num_attention_heads=25),
    "llama3-1b": dict(
        _LLAMA3,
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        ffn_hidden_size=8192,
        max_position_embeddings=131072,
    ),
    "llama3-8b": dict(
        _LLAMA3,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        ffn_hidden_size=14336,
        untie_embeddings_and_output_weights=True,
    ),
    "llama3-70b": dict(
        _LLAMA3,
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        ffn_hidden_size=28672,
        untie_embeddings_and_output_weights=True,
    ),
    "llama3-405b": dict(
        _LLAMA3,
        num_layers=126,
        hidden_size=16384,
        num_attention_heads=128,
        ffn_hidden_size=53248,
        untie_embeddings_and_output_weights=True,
    ),
    "gpt3-175b": dict(_GPT2, num_layers=96, hidden_size=12288, num_attention_heads=96, max_position_embeddings=2048),
    "debug-moe": dict(
        _LLAMA3,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=None,
        max_position_embeddings=256,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
    ),
    "mixtral-8x7b": dict(
        _LLAMA3,
        rotary_base=1000000.0,
        vocab_size=32000,
        max_position_embeddings=32768,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        ffn_hidden_size=14336,
        untie_embeddings_and_output_weights=True,
        num_experts=8,
        moe_router_topk=2,
    ),
    "qwen2-moe-a2.7b": dict(  # Qwen1.5-MoE-A2.7B
        _LLAMA3,
        rotary_base=1000000.0,
        norm_epsilon=1e-6,
        vocab_size=151936,
        num_query_groups=None,
        add_qkv_bias=True,
        max_position_embeddings=8192,
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        ffn_hidden_size=5632,
        untie_embeddings_and_output_weights=True,
        num_experts=60,
        moe_router_topk=4,
        moe_router_pre_softmax=True,
        moe_ffn_hidden_size=1408,
        moe_shared_expert_intermediate_size=5632,
        moe_shared_expert_gate=True,
    ),
    "olmoe-1b-7b": dict(  # OLMoE-1B-7B-0924 (without its query/key norms)
        _LLAMA3,
        rotary_base=10000.0,
        vocab_size=50304,
        num_query_groups=None,
        max_position_embeddings=4096,
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        ffn_hidden_size=1024,
        untie_embeddings_and_output_weights=True,
        num_experts=64,
        moe_router_topk=8,
        moe_router_pre_softmax=True,
    ),
    "deepseek-v2-lite-16b": dict(  # DeepSeek-V2-Lite: its config.json's shapes
        _DEEPSEEK,
        vocab_size=102400,
        num_layers=27,
        hidden_size=2048,
        num_attention_heads=16,
        ffn_hidden_size=10944,
        moe_layer_freq="([0]*1+[1]*26)",
        num_experts=64,
        moe_router_topk=6,
        moe_router_pre_softmax=True,
        moe_ffn_hidden_size=1408,
        moe_shared_expert_intermediate_size=2 * 1408,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    "deepseek-v3-671b": dict(  # DeepSeek-V3: its config.json's shapes (its one MTP module not built)
        _DEEPSEEK_V3,
        vocab_size=129280,
        num_attention_heads=128,
        moe_layer_freq="([0]*3+[1]*58)",
        num_experts=256,
        moe_router_topk_scaling_factor=2.5,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
    ),
    "kimi-k2-1t": dict(  # Kimi-K2 (model type kimi_k2: DeepSeek-V3's architecture): its config.json's shapes
        _DEEPSEEK_V3,
        rotary_base=50000.0,
        rotary_scaling_factor=32.0,
        max_position_embeddings=131072,
        vocab_size=163840,
        num_attention_heads=64,
        moe_layer_freq="([0]*1+[1]*60)",
        num_experts=384,
        moe_router_topk_scaling_factor=2.827,
    ),
}

PUBLISHED_PARAMETERS: dict[str, int] = {
    "gpt2-small": 124_439_808,  # Hugging Face gpt2
    "gpt2-medium": 354_823_168,  # Hugging Face gpt2-medium
    "gpt2-xl": 1_557_611_200,  # Hugging Face gpt2-xl
    "llama3-1b": 1_235_814_400,  # Llama 3.2 1B
    "llama3-8b": 8_030_261_248,  # Llama 3 8B
    "llama3-70b": 70_553_706_496,  # Llama 3 70B
    "llama3-405b": 405_853_388_800,  # Llama 3.1 405B, "405B"
    "gpt3-175b": 175_000_000_000,  # Brown et al. 2020, "175B"
    "mixtral-8x7b": 46_702_792_704,  # Mixtral-8x7B-v0.1, "46.7B"
    "qwen2-moe-a2.7b": 14_300_000_000,  # Qwen1.5-MoE-A2.7B, "14.3B"
    "olmoe-1b-7b": 6_919_161_856,  # OLMoE-1B-7B-0924, "6.9B" (its QK norms included)
    "deepseek-v2-lite-16b": 15_700_000_000,  # DeepSeek-V2-Lite, "15.7B"
    "deepseek-v3-671b": 671_000_000_000,  # DeepSeek-V3, "671B": the main model (its MTP module, 14B, left out)
}

PUBLISHED_ACTIVE_PARAMETERS: dict[str, int] = {
    "mixtral-8x7b": 12_900_000_000,  # "12.9B active"
    "qwen2-moe-a2.7b": 2_700_000_000,  # "2.7B activated"
    "olmoe-1b-7b": 1_282_017_280,  # "1.3B active": its config, top-8 of 64 experts, QK norms included
}
"""Parameters a token uses (embeddings and every dense weight, top-k of the experts), for MoE entries. (DeepSeek's
"activated" figures leave the input embedding out: they are not compared here.)"""


MODERN_TRAINING: dict[str, Any] = dict(hidden_dropout=0.0, attention_dropout=0.0)
"""What every preset sets beside its sizes: no dropout, as today's large models train (the defaults are
Megatron-LM's 0.1, for its scripts)."""


def model_preset(name: str) -> dict[str, Any]:
    """The registry entry as field overrides, `model_name` included. A setting an entry leaves to its default (None:
    one key/value head per query head, the tokenizer's vocabulary) is not among them, so that the setting falls back
    to the run's lower layers: the checkpoint's, for a run that loads one."""
    if name not in MODELS:
        raise ConfigError(f"--model {name}: unknown model; choose one of {', '.join(MODELS)}")
    entry = {setting: value for setting, value in MODELS[name].items() if value is not None}
    grouped = {"group_query_attention": True} if entry.get("num_query_groups") else {}
    return {"model_name": name, **MODERN_TRAINING, **grouped, **entry}
