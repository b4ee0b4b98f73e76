"""Hugging Face interop against transformers itself: random-weight models built locally (no
download) convert to paratron and back, and every direction gives transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # the reference; installed with the test extras

from paratron.checkpoint import load_pretrained
from paratron.checkpoint.formats import hf_to_paratron, paratron_to_hf
from paratron.errors import CheckpointError

from tiny import save_random_hf_model

LLAMA = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
)
MODELS = {
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(LLAMA, tie_word_embeddings=True)),
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(LLAMA, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(LLAMA, sliding_window=None, tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(LLAMA, sliding_window=8, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(LLAMA, tie_word_embeddings=True)),
    "qwen2-window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(LLAMA, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=0),
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
}
TOLERANCE = 1e-4


def hf_model(name: str, directory):
    config_class, model_class, settings = MODELS[name]
    config = getattr(transformers, config_class)(**settings)
    return save_random_hf_model(getattr(transformers, model_class), config, directory)


@pytest.mark.parametrize("name", list(MODELS))
def test_conversion_both_ways_matches_transformers(tmp_path, name):
    reference = hf_model(name, tmp_path / "hf")
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        direct = load_pretrained(tmp_path / "hf")(ids)  # a Hugging Face directory loads as it is
        hf_to_paratron(tmp_path / "hf", tmp_path / "paratron")
        converted = load_pretrained(tmp_path / "paratron")(ids)
    assert (direct - expected).abs().max() < TOLERANCE
    assert (converted - expected).abs().max() < TOLERANCE
    if name == "qwen2":
        assert load_pretrained(tmp_path / "paratron").layers[0].attention.in_proj.q.bias is not None
    if name.endswith("-window"):  # sequences of 24 tokens, three windows of 8: the window is carried
        config = load_pretrained(tmp_path / "paratron").config
        assert (config.attention_type, config.window_size) == ("sliding-window", 8)

    paratron_to_hf(tmp_path / "paratron", tmp_path / "back")
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["model_type"] == reference.config.model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert (back(ids).logits - expected).abs().max() < TOLERANCE


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json; give a Hugging Face model directory"):
        hf_to_paratron(tmp_path, tmp_path / "out")
    hf_model("llama-tied", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    with pytest.raises(CheckpointError, match="model_type 'bert' is not supported"):
        hf_to_paratron(tmp_path / "bert", tmp_path / "out")
    hf_to_paratron(tmp_path / "hf", tmp_path / "out")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        hf_to_paratron(tmp_path / "hf", tmp_path / "out")  # nothing existing is overwritten


def test_windows_paratron_cannot_represent_are_refused_by_name(tmp_path):
    mixed = dict(LLAMA, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    save_random_hf_model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**mixed), tmp_path / "mixed")
    with pytest.raises(CheckpointError, match="some layers use sliding-window attention and others full attention"):
        hf_to_paratron(tmp_path / "mixed", tmp_path / "out")
    with pytest.raises(CheckpointError, match="some layers use sliding-window attention and others full attention"):
        load_pretrained(tmp_path / "mixed")


def test_block_sparse_models_are_refused_on_export(tmp_path):
    from paratron.checkpoint.hf import hf_config
    from paratron.config.schema import ModelConfig

    model = ModelConfig(
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        vocab_size=97,
        attention_type="block-sparse",
    )
    with pytest.raises(CheckpointError, match="--attention-type block-sparse has no equivalent in Hugging Face's"):
        hf_config(model, "llama")
