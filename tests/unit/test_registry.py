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
