"""LoRA adapters: the adapted layer's arithmetic, freezing, merging, one-line errors, and the
PEFT export against peft itself (random-weight Hugging Face models built locally)."""

from __future__ import annotations

import json
import math

import peft  # the references; installed with the test extras
import pytest
import torch
import torch.nn.functional as F
import transformers

from paratron.checkpoint.formats import hf_to_paratron, paratron_to_hf, paratron_to_peft
from paratron.checkpoint.hf import model_from_hf
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.config import build_config
from paratron.config.loading import override
from paratron.errors import CheckpointError, ConfigError
from paratron.model.gpt import build_model
from paratron.model.lora import (
    LoRALinear,
    add_adapters,
    init_adapter,
    is_adapter,
    merge_adapters,
    parse_targets,
)

from tiny import FLAVOURS, GPT_FLAVOUR, LLAMA_FLAVOUR, save_random_hf_model

ALL = "qkv,proj,fc1,fc2"


def randomize_adapters(model: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> None:
    """Give every adapter matrix random values (B starts at zero, which would hide mistakes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


def test_lora_linear_adds_the_scaled_low_rank_update():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 6)
    weight, bias = base.weight, base.bias
    layer = LoRALinear(base, rank=3, alpha=6.0)
    assert layer.weight is weight and layer.bias is bias and layer.scaling == 2.0
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias", "lora_a", "lora_b"]
    assert layer.lora_a.shape == (3, 8) and layer.lora_b.shape == (6, 3)
    with torch.no_grad():
        layer.lora_a.normal_()
        layer.lora_b.normal_()
    x = torch.randn(2, 5, 8)
    expected = x @ weight.T + bias + 2.0 * (x @ layer.lora_a.T) @ layer.lora_b.T
    assert torch.allclose(layer(x), expected, atol=1e-5)
    assert not torch.allclose(layer(x), F.linear(x, weight, bias), atol=1e-2)  # the update counts

    with torch.device("meta"):  # built before weights exist
        meta = LoRALinear(torch.nn.Linear(8, 6, bias=False), rank=2, alpha=4.0)
    assert meta.lora_a.is_meta and meta.lora_b.shape == (6, 2) and meta.bias is None


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fresh_adapters_keep_the_base_logits_and_only_adapters_train(flavour):
    config = FLAVOURS[flavour]
    model = build_model(config, seed=3)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids)
    add_adapters(model, rank=4, alpha=8.0, targets=ALL)
    with torch.no_grad():
        assert torch.equal(model(ids), before)  # B = 0: exactly the base model

    per_block = 14 if flavour == "llama" else 12  # (q, k, v, out, [gate,] up, down) x (A, B)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained == [n for n, _ in model.named_parameters() if is_adapter(n)]
    assert len(trained) == per_block * config.num_layers
    a = model.layers[0].mlp.out_proj.lora_a  # A ~ U(+-1/sqrt(in)), B = 0
    inner = a.shape[1]
    assert a.abs().max() <= 1 / math.sqrt(inner) and a.std() > 0.5 / math.sqrt(3 * inner)
    assert torch.all(model.layers[0].mlp.out_proj.lora_b == 0)

    randomize_adapters(model)
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    for name, param in model.named_parameters():
        if is_adapter(name):
            assert param.grad is not None and param.grad.abs().max() > 0, name
        else:
            assert param.grad is None, name


def test_targets_choose_the_layers_and_adding_twice_changes_nothing():
    model = build_model(LLAMA_FLAVOUR, seed=0)
    add_adapters(model, rank=2, alpha=4.0, targets="qkv, fc2")
    adapted = {n.removesuffix(".lora_a") for n, _ in model.named_parameters() if n.endswith("lora_a")}
    assert adapted == {
        f"layers.{i}.{layer}"
        for i in range(2)
        for layer in ("attention.in_proj.q", "attention.in_proj.k", "attention.in_proj.v", "mlp.out_proj")
    }
    first = model.layers[0].attention.in_proj.q
    add_adapters(model, rank=2, alpha=4.0, targets="qkv,fc2")
    assert model.layers[0].attention.in_proj.q is first
    assert not model.layers[0].attention.out_proj.weight.requires_grad  # untargeted layers are frozen too


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_merged_weights_give_the_adapter_model_logits(flavour):
    config = FLAVOURS[flavour]
    model = build_model(config, seed=4)
    add_adapters(model, rank=4, alpha=8.0, targets=ALL)
    randomize_adapters(model, seed=2)
    merged = merge_adapters(model.state_dict(), alpha=8.0, rank=4)
    assert not any(is_adapter(n) for n in merged)
    plain = build_model(config, seed=9)
    plain.load_state_dict(merged)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted, base = model(ids), build_model(config, seed=4)(ids)
        difference = (plain(ids) - adapted).abs().max()
    assert difference < 1e-5
    assert (adapted - base).abs().max() > 1e-2  # the adapters changed the model


def test_init_adapter_handles_only_adapters():
    a, b, w = torch.empty(4, 100), torch.ones(50, 4), torch.ones(3, 3)
    assert init_adapter("layers.0.mlp.out_proj.lora_a", a, torch.Generator().manual_seed(7))
    assert init_adapter("layers.0.mlp.out_proj.lora_b", b, torch.Generator().manual_seed(7))
    assert not init_adapter("layers.0.mlp.out_proj.weight", w, torch.Generator().manual_seed(7))
    assert torch.all(b == 0) and torch.all(w == 1)
    assert a.abs().max() <= 0.1 and a.abs().max() > 0.09  # U(-1/sqrt(100), 1/sqrt(100))
    again = torch.empty(4, 100)
    init_adapter("x.lora_a", again, torch.Generator().manual_seed(7))
    assert torch.equal(a, again)  # drawn from the generator alone


def test_bad_settings_are_one_line_errors():
    assert parse_targets(" fc2,qkv,fc2 ") == ("fc2", "qkv")
    with pytest.raises(ConfigError, match=r"^--lora-targets attn: unknown layer; choose from qkv, proj, fc1, fc2$"):
        parse_targets("qkv,attn")
    with pytest.raises(ConfigError, match="^--lora-targets ' , ': names no layer"):
        parse_targets(" , ")
    model = build_model(GPT_FLAVOUR)
    with pytest.raises(ConfigError, match="^--lora-rank 0: must be at least 1$"):
        add_adapters(model, rank=0, alpha=16.0, targets=ALL)


# ---------------------------------------------------------------- PEFT export against peft

HF_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}
HF_SHAPE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def hf_model(kind: str, directory):
    config_class, model_class = HF_MODELS[kind]
    config = getattr(transformers, config_class)(**HF_SHAPE)
    return save_random_hf_model(getattr(transformers, model_class), config, directory)


def adapter_checkpoint(tmp_path, kind: str):
    """A paratron checkpoint of a converted Hugging Face model with random adapters, and that model."""
    hf_model(kind, tmp_path / "hf")
    hf_to_paratron(tmp_path / "hf", tmp_path / "converted")
    config = override(read_checkpoint(tmp_path / "converted").config, lora_rank=4, lora_alpha=8.0)
    model = model_from_hf(tmp_path / "hf")
    add_adapters(model, rank=4, alpha=8.0, targets=ALL)
    randomize_adapters(model, seed=5)
    content = CheckpointContent(0, 0, config, model, extra_meta={"hf_model_type": kind})
    save_checkpoint(tmp_path / "tuned", content)
    return model


@pytest.mark.parametrize("kind", HF_MODELS)
def test_peft_export_loads_in_peft_with_the_same_logits(tmp_path, kind):
    ours = adapter_checkpoint(tmp_path, kind)
    paratron_to_peft(tmp_path / "tuned", tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8 and saved["peft_type"] == "LORA"
    assert saved["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    base = getattr(transformers, HF_MODELS[kind][1]).from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = base(ids).logits
        tuned = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        expected, got = tuned(ids).logits, ours.eval()(ids)
    assert len(tuned.base_model.model.model.layers[1].self_attn.q_proj.lora_A) == 1  # the adapter was applied
    assert (expected - plain).abs().max() > 1e-2  # ... and changes the model
    assert (got - expected).abs().max() < 1e-4


def test_peft_export_refusals(tmp_path):
    hf_model("llama", tmp_path / "hf")
    hf_to_paratron(tmp_path / "hf", tmp_path / "converted")
    with pytest.raises(CheckpointError, match="holds no LoRA adapters; train with --lora-rank"):
        paratron_to_peft(tmp_path / "converted", tmp_path / "out")

    config = build_config(
        dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, mock_data=True, lora_rank=2)
    )
    gpt = build_model(config.model)
    add_adapters(gpt, rank=2, alpha=16.0, targets=ALL)
    save_checkpoint(tmp_path / "gpt", CheckpointContent(0, 0, config, gpt))
    with pytest.raises(CheckpointError) as refused:
        paratron_to_peft(tmp_path / "gpt", tmp_path / "out")
    assert str(refused.value).endswith(
        "a gpt2 model; PEFT export supports llama, mistral, qwen2, qwen3 models; convert with --to hf DIR "
        "--merge-lora instead, which writes the adapters merged into the base weights"
    )
    with pytest.raises(CheckpointError) as unmerged:  # (the fix it names for a family PEFT does not cover)
        paratron_to_hf(tmp_path / "gpt", tmp_path / "plain")
    assert str(unmerged.value).endswith(
        "holds LoRA adapters; add --merge-lora to write them merged into the base weights"
    )
    merged = paratron_to_hf(tmp_path / "gpt", tmp_path / "merged", merge_lora=True)
    assert json.loads((merged / "config.json").read_text())["model_type"] == "gpt2"
    adapter_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(CheckpointError) as unmerged:  # (a family PEFT covers: both ways named)
        paratron_to_hf(tmp_path / "llama" / "tuned", tmp_path / "plain")
    assert str(unmerged.value).endswith(
        "--merge-lora to write them merged into the base weights, or convert with --to peft DIR to write the "
        "adapters alone"
    )

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        paratron_to_peft(tmp_path / "converted", tmp_path / "busy")
    assert not (tmp_path / "out").exists()
