"""Mixtral, Qwen2-MoE and Qwen3-MoE (and Qwen3, whose query/key norms it shares) from Hugging
Face: converted weights give transformers' logits, and convert back to the same tensors."""

from __future__ import annotations

import pytest
import torch
import transformers  # the reference; installed with the test extras
from safetensors import safe_open

from paratron.checkpoint import load_pretrained
from paratron.checkpoint.formats import hf_to_paratron, paratron_to_hf

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
MODELS = {
    "mixtral-top2": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig(**SHAPE, num_local_experts=3, num_experts_per_tok=2),
    ),
    "mixtral-top1": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=1),
    ),
    "qwen2-moe": (
        transformers.Qwen2MoeForCausalLM,
        transformers.Qwen2MoeConfig(
            **SHAPE,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            decoder_sparse_step=1,
            mlp_only_layers=[1],  # a dense layer between two MoE layers
            norm_topk_prob=False,
        ),
    ),
    "qwen3-moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(
            **SHAPE,
            head_dim=12,  # (not hidden / heads)
            num_experts=3,
            num_experts_per_tok=2,
            moe_intermediate_size=20,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
    ),
    "qwen3-moe-top1": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=20),
    ),
    "qwen3-dense": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**SHAPE, head_dim=12)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_moe_gives_transformers_logits_and_converts_back(tmp_path, name):
    model_class, config = MODELS[name]
    torch.manual_seed(0)
    reference = model_class(config).eval()
    with torch.no_grad():  # routers away from ties
        for module in reference.modules():
            if hasattr(module, "gate") and isinstance(module.gate, torch.nn.Module):
                for param in module.gate.parameters():
                    param.normal_(0, 0.5)
    reference.save_pretrained(tmp_path / "hf")
    hf_to_paratron(tmp_path / "hf", tmp_path / "paratron")
    ours = load_pretrained(tmp_path / "paratron")
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-4, atol=1e-4)
    paratron_to_hf(tmp_path / "paratron", tmp_path / "back")
    with (
        safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as a,
        safe_open(str(tmp_path / "back" / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    again = model_class.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, rtol=0, atol=0)
