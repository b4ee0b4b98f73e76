"""Squared ReLU (Nemotron-4's MLP activation, Megatron-LM's --squared-relu): the flag, the MLP's numbers and
gradients, and how checkpoints carry it (Megatron-LM's `squared_relu` arg both ways; Hugging Face refused in one
line). Its tensor-parallel parity is a flavour of tests/parallel/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from paratron.checkpoint import megatron as mc
from paratron.checkpoint.formats import megatron_to_paratron, paratron_to_hf, paratron_to_megatron
from paratron.checkpoint.hf import hf_config, model_type_of
from paratron.checkpoint.load import model_from_checkpoint
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.commands.train import train_config
from paratron.config import build_config
from paratron.config.megatron import from_megatron_dict
from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError
from paratron.model.gpt import build_model
from paratron.model.mlp import MLP

SMALL = dict(hidden_size=32, num_attention_heads=4, hidden_dropout=0.0)


def test_megatron_flag_and_native_setting_select_it():
    megatron = train_config(["--squared-relu", "--mock-data"])
    native = train_config(["--activation", "squared_relu", "--mock-data"])
    assert megatron.model.activation == native.model.activation == "squared_relu"
    assert megatron.model.ffn_hidden_size == 4 * megatron.model.hidden_size  # (not gated: GELU's width)
    assert from_megatron_dict({"squared_relu": True}) == {"activation": "squared_relu"}  # (tutorials' dict form)


def test_mlp_computes_relu_squared_and_its_gradient():
    mlp = MLP(ModelConfig(**SMALL, activation="squared_relu"))
    assert list(mlp.in_proj) == ["up"]  # one projection: not gated
    x = torch.randn(3, 5, 32, requires_grad=True)
    (up,) = mlp.in_proj(x)
    by_hand = torch.where(up > 0, up * up, torch.zeros_like(up))
    assert (by_hand == 0).any() and (by_hand > 0).any()  # (both sides of the kink)
    out = mlp(x)
    torch.testing.assert_close(out, mlp.out_proj(by_hand), rtol=0, atol=1e-6)
    out.sum().backward()
    # d/dx relu(x)^2 = 2 relu(x): the input gradient through the up-projection, by hand
    grad_h = torch.ones_like(out) @ mlp.out_proj.weight
    grad_up = 2 * torch.clamp(up.detach(), min=0) * grad_h
    torch.testing.assert_close(x.grad, grad_up @ mlp.in_proj["up"].weight, rtol=1e-5, atol=1e-6)


def test_megatron_checkpoint_args_carry_it_both_ways(tmp_path):
    config = build_config(dict(SMALL, num_layers=2, vocab_size=64, activation="squared_relu", mock_data=True))
    model = build_model(config.model, "cpu", seed=3)
    save_checkpoint(tmp_path / "native", CheckpointContent(5, 40, config, model))
    written = paratron_to_megatron(tmp_path / "native", tmp_path / "megatron", tp=2)
    args = vars(torch.load(written / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["args"])
    assert (args["squared_relu"], args["swiglu"]) == (True, False)
    back = megatron_to_paratron(tmp_path / "megatron", tmp_path / "back")
    returned = read_checkpoint(back)
    assert returned.config.model.activation == "squared_relu"
    a, b = dict(model.named_parameters()), dict(model_from_checkpoint(returned).named_parameters())
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(CheckpointError, match="--squared-relu with --swiglu"):
        mc.model_settings({**args, "swiglu": True})


def test_hugging_face_export_is_refused_in_one_line(tmp_path):
    m = ModelConfig(**SMALL, vocab_size=64, activation="squared_relu")
    for attempt in (lambda: model_type_of(m), lambda: hf_config(m, "gpt2")):
        with pytest.raises(CheckpointError, match=r"--squared-relu .*relu2.* keep it as a paratron") as e:
            attempt()
        assert "\n" not in str(e.value)
    config = build_config(dict(SMALL, num_layers=1, vocab_size=64, activation="squared_relu", mock_data=True))
    save_checkpoint(tmp_path / "native", CheckpointContent(0, 0, config, build_model(config.model, "cpu", seed=0)))
    with pytest.raises(CheckpointError, match="--squared-relu"):
        paratron_to_hf(tmp_path / "native", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_hugging_face_relu2_configs_are_refused_in_one_line():
    from paratron.checkpoint.hf import model_settings

    nemotron = {"model_type": "nemotron", "architectures": ["NemotronForCausalLM"], "hidden_act": "relu2"}
    llama_relu2 = {"model_type": "llama", "hidden_act": "relu2", "hidden_size": 32, "num_attention_heads": 4}
    for config, message in (
        (nemotron, "model_type 'nemotron' .*is not supported; convert one of"),
        (llama_relu2, "hidden_act 'relu2' is not supported"),
    ):
        with pytest.raises(CheckpointError, match=message) as e:
            model_settings(config)
        assert "\n" not in str(e.value)
