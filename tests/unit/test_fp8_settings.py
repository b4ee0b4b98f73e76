"""--fp8-format is refused in one line where it cannot run: outside bf16, on a device
without fp8 matmuls (the CPU; CUDA below compute capability 8.9, faked), and without torchao installed; its
fp8 weight gather with tensor parallelism."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.commands.train import train_config
from paratron.config.validation import validate
from paratron.distributed.init import has_fp8_matmuls
from paratron.errors import ConfigError
from paratron.model.gpt import GPT
from paratron.parallel import fp8
from paratron.parallel.fp8 import check_fp8, fp8_layer
from paratron.planning.dry_run import run_dry_run

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
TINY += ["--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1", "--mock-data"]


def one_line(call, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as error:
        call()
    assert "\n" not in str(error.value)


def test_the_settings_take_megatrons_flag_names():
    config = train_config([*TINY, "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"])
    assert (config.training.fp8_format, config.training.fp8_recipe) == ("hybrid", "rowwise")
    assert validate(config, 1).tp == 1
    assert train_config(TINY).training.fp8_format is None


def test_fp8_needs_bf16_and_its_weight_gather_no_tensor_parallelism():
    config = train_config([*TINY, "--fp8-format", "e4m3"])
    one_line(
        lambda: validate(config, 1), r"^--fp8-format e4m3 runs inside bf16 training \(this run is fp32\); add --bf16"
    )
    config = train_config([*TINY, "--bf16", "--fp8-format", "e4m3", "--tensor-model-parallel-size", "2"])
    assert validate(config, 2).tp == 2  # (the tensor-parallel layers have fp8 twins)
    config = train_config([*TINY, "--bf16", "--fp8-format", "e4m3", "--fp8-param-gather", "--zero-stage", "3"])
    one_line(
        lambda: validate(
            dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tensor_model_parallel_size=2)), 4
        ),
        r"tensor-parallel fp8 layers gather their weights in bf16; drop --fp8-param-gather",
    )


def test_a_device_without_fp8_matmuls_is_refused(monkeypatch):
    training = train_config([*TINY, "--bf16", "--fp8-format", "e4m3"]).training
    assert not has_fp8_matmuls("cpu") and not has_fp8_matmuls("mps")
    one_line(lambda: check_fp8(training, "cpu"), r"^--fp8-format e4m3: this device \(cpu\) has no fp8 matmuls.*8\.9")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, has in [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0, c=capability: c)
        assert has_fp8_matmuls("cuda") is has, capability
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 0))
    one_line(lambda: check_fp8(training, "cuda"), r"this device \(cuda\) has no fp8 matmuls")
    check_fp8(train_config([*TINY, "--bf16"]).training, "cpu")  # (no fp8 asked for: nothing to refuse)


def test_without_torchao_the_refusal_names_the_install(monkeypatch):
    training = train_config([*TINY, "--bf16", "--fp8-format", "hybrid"]).training
    monkeypatch.setattr(fp8, "has_fp8_matmuls", lambda device_type: device_type == "cuda")
    monkeypatch.setattr(fp8.importlib.util, "find_spec", lambda name: None)
    one_line(lambda: check_fp8(training, "cuda"), r"^--fp8-format hybrid: .*torchao.*pip install torchao")


PARTS = ("in_proj.q", "in_proj.k", "in_proj.v", "out_proj")


def test_the_output_layer_and_odd_widths_stay_in_bf16():
    with torch.device("meta"):
        model = GPT(train_config([*TINY, "--vocab-size", "256", "--ffn-hidden-size", "100"]).model)
    chosen = [name for name, module in model.named_modules() if fp8_layer(module, name)]
    assert chosen == [f"layers.{n}.attention.{part}" for n in (0, 1) for part in PARTS]
    assert all(not fp8_layer(module, name) for name, module in model.named_modules() if "mlp" in name)  # (100)
    assert not fp8_layer(model.output, "output") and not fp8_layer(torch.nn.LayerNorm(64), "layers.0.norm")


def test_a_dry_run_prices_fp8_without_the_device(capsys):
    config = train_config([*TINY, "--bf16", "--fp8-format", "e4m3", "--dry-run", "--world-size", "2"])
    assert run_dry_run(config) == 0
    assert "rank role" in capsys.readouterr().out
