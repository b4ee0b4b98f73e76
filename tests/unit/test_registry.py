"""Named model sizes have the published parameter counts (within 0.5%), counted on the meta device."""

from __future__ import annotations

import pytest

from paratron.model.registry import (
    MODELS,
    PUBLISHED_ACTIVE_PARAMETERS,
    PUBLISHED_PARAMETERS,
    count_active_parameters,
    count_parameters,
    model_config,
)
from paratron.training.flops import matmul_parameters


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_parameter_counts_match_published(name):
    counted = count_parameters(model_config(name))
    published = PUBLISHED_PARAMETERS[name]
    assert abs(counted - published) / published < 0.005, f"{name}: {counted:,} vs {published:,}"


def test_exact_counts_of_reference_implementations():
    # Hugging Face's gpt2 and Meta's Llama 3 8B, to the parameter.
    assert count_parameters(model_config("gpt2-small")) == 124_439_808
    assert count_parameters(model_config("llama3-8b")) == 8_030_261_248
    assert count_parameters(model_config("llama3-1b")) == 1_235_814_400  # tied embeddings counted once


def test_registry_has_the_required_sizes():
    assert {"debug", "gpt2-small", "gpt2-xl", "llama3-1b", "llama3-8b", "llama3-70b", "gpt3-175b"} <= set(MODELS)
    assert {"debug-moe", "mixtral-8x7b", "qwen2-moe-a2.7b", "olmoe-1b-7b"} <= set(MODELS)
    assert count_parameters(model_config("debug", vocab_size=512)) < 1_000_000
    assert count_parameters(model_config("debug-moe", vocab_size=512)) < 1_000_000


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE_PARAMETERS))
def test_active_parameter_counts_match_published(name):
    config = model_config(name)
    active, published = count_active_parameters(config), PUBLISHED_ACTIVE_PARAMETERS[name]
    assert abs(active - published) / published < 0.005, f"{name}: {active:,} vs {published:,}"
    # FLOPs count the active matmul weights: the active parameters less norms, biases and the input embedding
    others = sum(size for name, size in _named_sizes(config) if "norm" in name or name.endswith("bias"))
    assert matmul_parameters(config) == active - others - config.vocab_size * config.hidden_size


def _named_sizes(config):
    import torch

    from paratron.model.gpt import GPT

    with torch.device("meta"):
        return [(n, p.numel()) for n, p in GPT(config).named_parameters()]


DEEPSEEK_CONFIG_JSON = {  # (the shapes of each model's published config.json)
    "deepseek-v2-lite-16b": (
        "DeepseekV2",
        dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=2,
            n_routed_experts=64,
            num_experts_per_tok=6,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    ),
    "deepseek-v3-671b": (
        "DeepseekV3",
        dict(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_shared_experts=1,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=3,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    ),
    "kimi-k2-1t": (  # (model type kimi_k2: DeepSeek-V3's architecture)
        "DeepseekV3",
        dict(
            vocab_size=163840,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=64,
            num_key_value_heads=64,
            n_shared_experts=1,
            n_routed_experts=384,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(DEEPSEEK_CONFIG_JSON))
def test_deepseek_presets_count_what_transformers_builds_from_their_config_json(name):
    """Each DeepSeek-class preset has, to the parameter, the parameters of transformers' model built on the meta
    device from the published config.json's shapes (the main model: DeepSeek-V3's one MTP module is not built,
    and the 671B of its name leave it out too)."""
    import torch
    import transformers

    family, shapes = DEEPSEEK_CONFIG_JSON[name]
    config = getattr(transformers, f"{family}Config")(**shapes, tie_word_embeddings=False)
    with torch.device("meta"):
        reference = getattr(transformers, f"{family}ForCausalLM")(config)
    assert count_parameters(model_config(name)) == sum(p.numel() for p in reference.parameters())
