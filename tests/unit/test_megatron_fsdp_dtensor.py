"""Megatron-LM's fsdp_dtensor checkpoints (Megatron FSDP's torch.distributed.checkpoint files) read by
paratron: a tiny one written in process (world 1) under the names Megatron-LM main writes
(`model.module.NAME` per layer, a SwiGLU fc1 split into `weight_w` / `weight_v`, args and iteration as
pickled objects) converts to exactly the weights it was made from."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratron.checkpoint import megatron as mc
from paratron.checkpoint.formats import megatron_to_paratron
from paratron.checkpoint.load import model_from_checkpoint
from paratron.checkpoint.megatron.fsdp_dtensor import fsdp_weights
from paratron.checkpoint.verify import read_checkpoint
from paratron.config import build_config
from paratron.errors import CheckpointError
from paratron.model.gpt import build_model

SETTINGS = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=120, seq_length=16,
    max_position_embeddings=16, activation="swiglu", normalization="RMSNorm", add_bias_linear=False,
    position_embedding_type="rope", untie_embeddings_and_output_weights=True, group_query_attention=True,
    num_query_groups=2,
)  # fmt: skip


def write_fsdp_dtensor(root: Path, iteration: int = 7, consumed: int = 56) -> dict[str, torch.Tensor]:
    """A Megatron FSDP-style checkpoint of a fresh paratron model under ROOT; the model's weights."""
    config = build_config(SETTINGS)
    torch.manual_seed(0)
    model = build_model(config.model)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    padded = mc.padded_vocab(120, config.model.make_vocab_size_divisible_by, 1)
    state: dict[str, object] = {}
    for name, tensor in mc.from_paratron(weights, config.model, padded).items():
        if name.endswith("linear_fc1.weight"):  # (as Megatron-LM's handle_swiglu_in_state_dict splits it)
            gate, up = tensor.chunk(2)
            state[f"model.module.{name}_w"], state[f"model.module.{name}_v"] = gate, up
        else:
            state[f"model.module.{name}"] = tensor
    state["args"] = mc.megatron_args(config, 1, 1, padded, iteration, consumed)
    state["iteration"], state["checkpoint_version"] = iteration, 3.0
    folder = root / f"iter_{iteration:07d}"
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return weights


def test_an_fsdp_dtensor_checkpoint_converts_exactly(tmp_path):
    weights = write_fsdp_dtensor(tmp_path / "megatron")
    assert mc.detect_format(tmp_path / "megatron") == "fsdp_dtensor"
    assert mc.check_load(tmp_path / "megatron", "fsdp_dtensor") == "fsdp_dtensor"
    with pytest.raises(CheckpointError, match="^--ckpt-format torch_dist: .* holds a fsdp_dtensor checkpoint"):
        mc.check_load(tmp_path / "megatron", "torch_dist")
    megatron_to_paratron(tmp_path / "megatron", tmp_path / "converted")
    assert mc.check_load(tmp_path / "converted", "fsdp_dtensor") == "paratron"  # (what a script's --save holds)
    info = read_checkpoint(tmp_path / "converted")
    assert (info.iteration, info.consumed_samples) == (7, 56)
    converted = dict(model_from_checkpoint(info).named_parameters())
    assert set(converted) == set(weights)
    assert all(torch.equal(converted[name], weights[name]) for name in weights)


def test_a_lost_half_or_a_foreign_object_is_one_line(tmp_path):
    folder = tmp_path / "half"
    dcp.save({"model.module.decoder.layers.0.mlp.linear_fc1.weight_w": torch.ones(2, 2)}, checkpoint_id=str(folder),
             no_dist=True)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"linear_fc1.weight has only its gate half"):
        fsdp_weights(folder)
    foreign = tmp_path / "foreign"
    state = {"model.module.x": torch.ones(1), "args": datetime.date(2020, 1, 1)}
    dcp.save(state, checkpoint_id=str(foreign), no_dist=True)
    with pytest.raises(CheckpointError, match=r"\(args\): holds the class datetime.date"):
        mc.open_megatron(foreign)
