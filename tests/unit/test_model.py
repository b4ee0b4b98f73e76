"""The GPT family: shapes, flavours, tying, seed-only initialization, causality and the KV cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.inference.generate import generate
from paratron.model import init
from paratron.model.gpt import build_model

from tiny import FLAVOURS, GPT_FLAVOUR, LLAMA_FLAVOUR, decoding_error


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_forward_shapes_and_structure(flavour):
    config = FLAVOURS[flavour]
    model = build_model(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (3, 11))
    assert model(ids).shape == (3, 11, config.vocab_size)
    attention = model.layers[0].attention
    groups = config.num_query_groups or config.num_attention_heads
    assert attention.in_proj.k.weight.shape == (groups * 8, 32)
    assert (attention.in_proj.q.bias is None) == (not config.add_bias_linear)
    assert (model.position_embedding is None) == (flavour == "llama")
    assert isinstance(model.final_norm, torch.nn.RMSNorm if flavour == "llama" else torch.nn.LayerNorm)
    assert list(model.layers[0].mlp.in_proj) == (["gate", "up"] if flavour == "llama" else ["up"])
    assert (model.output.weight is model.embedding.weight) == (flavour == "gpt")


def test_initialization_depends_only_on_seed_and_name():
    a = build_model(GPT_FLAVOUR, seed=5)
    b = build_model(GPT_FLAVOUR, seed=5)
    deeper = build_model(dataclasses.replace(GPT_FLAVOUR, num_layers=4), seed=5)
    other = build_model(GPT_FLAVOUR, seed=6)
    for name, p in a.named_parameters():
        assert torch.equal(p, dict(b.named_parameters())[name])
    q = "layers.1.attention.in_proj.q.weight"
    assert torch.equal(dict(a.named_parameters())[q], dict(deeper.named_parameters())[q])
    assert not torch.equal(dict(a.named_parameters())[q], dict(other.named_parameters())[q])
    # residual-stream projections are scaled by 1/sqrt(2 x layers); norms start at 1, biases at 0
    out = dict(a.named_parameters())["layers.0.attention.out_proj.weight"]
    assert out.std().item() == pytest.approx(0.02 / 2, rel=0.2)
    assert torch.all(a.layers[0].attention_norm.weight == 1) and torch.all(a.layers[0].mlp.in_proj.up.bias == 0)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_causal(flavour):
    config = FLAVOURS[flavour]
    model = build_model(config, seed=0).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % config.vocab_size
    torch.testing.assert_close(model(ids)[:, :8], model(changed)[:, :8])
    assert not torch.allclose(model(ids)[:, 8:], model(changed)[:, 8:])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_kv_cache_matches_full_forward(flavour):
    """The prompt in pieces of 4 tokens through the paged cache, then one token at a time."""
    config = FLAVOURS[flavour]
    model = build_model(config, seed=1).eval()
    prompt = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    assert decoding_error(model, prompt, new_tokens=5, chunk=4) < 1e-4


def test_greedy_generation_is_the_argmax_chain():
    model = build_model(LLAMA_FLAVOUR, seed=2).eval()
    prompt = [3, 1, 4, 1, 5]
    out = generate(model, prompt, 6)
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt) :]
    sampled = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=0)
    assert sampled == generate(model, prompt, 6, temperature=1.0, top_k=5, seed=0) and len(sampled) == 6


def test_dropout_only_in_training():
    config = dataclasses.replace(GPT_FLAVOUR, hidden_dropout=0.5, attention_dropout=0.5)
    model = build_model(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


def test_rows_of_the_init_equal_those_rows_of_the_whole_init(monkeypatch):
    # a block of 64 elements is two rows of the 97 x 32 embedding: 49 blocks
    monkeypatch.setattr(init, "INIT_BLOCK_ELEMENTS", 64)
    name, shape = "embedding.weight", (97, 32)
    assert init.init_block_rows(name, shape) == 2
    whole = torch.empty(shape)
    init.init_parameter(name, whole, GPT_FLAVOUR, seed=3)
    assert not torch.equal(whole[0:2], whole[2:4])  # (each block draws from its own generator)
    for a, b in [(0, 97), (0, 2), (1, 2), (3, 10), (5, 6), (95, 97), (96, 97), (40, 40)]:
        rows = torch.full((b - a, 32), float("nan"))
        init.init_rows(name, shape, slice(a, b), rows, GPT_FLAVOUR, seed=3)
        assert torch.equal(rows, whole[a:b]), (a, b)
    transposed = torch.empty(32, 97).T  # (a target that is not contiguous)
    init.init_rows(name, shape, slice(3, 97), transposed[3:], GPT_FLAVOUR, seed=3)
    assert torch.equal(transposed[3:], whole[3:])


def test_a_tensor_within_one_block_is_drawn_by_the_generator_of_its_name():
    name = "layers.0.attention.in_proj.q.weight"
    param = dict(build_model(GPT_FLAVOUR, seed=7).named_parameters())[name]
    generator = torch.Generator().manual_seed(init._stable_seed(7, name))
    expected = torch.empty(param.shape).normal_(0.0, GPT_FLAVOUR.init_method_std, generator=generator)
    assert torch.equal(param.detach(), expected)
