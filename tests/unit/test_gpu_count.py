"""GPUs are counted before any process starts: --nproc above them is one line with the fix; a
recipe's count runs on the GPUs there are, with the same global batch. The count is faked."""

from __future__ import annotations

import pytest
import torch

from paratron.cli import main
from paratron.commands import launching
from paratron.commands.train import train_config
from paratron.config.loading import build_config
from paratron.config.validation import validate
from paratron.distributed import init
from paratron.distributed.init import fit_to_devices, listed_devices, visible_devices
from paratron.errors import ConfigError


@pytest.mark.parametrize(
    "listed, count",
    [("0,1", 2), ("", 0), ("-1", 0), ("3", 1), ("0,-1,2", 1), ("0,0", 1), ("GPU-8a1f,MIG-2b3c", 2), (" 1, 0 ", 2)],
)
def test_cuda_visible_devices_as_cuda_reads_it(listed, count):
    assert listed_devices(listed) == count


def test_visible_devices_per_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices("auto") == 4 and visible_devices("nccl") == 4 and visible_devices("gloo") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert visible_devices("auto") == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_devices("auto") is None and visible_devices("nccl") == 0  # auto runs on the CPU then
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_devices("auto") is None


def gpus(monkeypatch, count: int | None) -> None:
    monkeypatch.setattr(init, "visible_devices", lambda backend="auto": count)
    for name in ("SLURM_JOB_ID", "SLURM_NNODES", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_an_explicit_nproc_above_the_gpus_is_one_line(monkeypatch, capsys):
    gpus(monkeypatch, 2)
    assert main(["train", "--config", "debug", "--mock-data", "--nproc", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --nproc 4: this machine has 2 GPUs visible (CUDA_VISIBLE_DEVICES honoured); use --nproc 2, or "
        "--distributed-backend gloo to run 4 processes on the CPU"
    ]
    with pytest.raises(
        ConfigError, match=r"^--nproc-per-node 8: this machine has 2 GPUs visible .* per node on the CPU$"
    ):
        argv = ["--config", "debug", "--mock-data", "--nproc-per-node", "8", "--nnodes", "2", "--master-addr", "h"]
        fit_to_devices(train_config(argv), ["train", *argv])


def test_nccl_without_a_gpu_says_so(monkeypatch):
    gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="^--distributed-backend nccl: this machine has no GPU visible"):
        fit_to_devices(build_config({"distributed_backend": "nccl", "mock_data": True}), ["train"])


def test_the_cpu_and_enough_gpus_change_nothing(monkeypatch):
    config = build_config({"nproc_per_node": 4, "mock_data": True})
    gpus(monkeypatch, None)
    assert fit_to_devices(config, ["train"]) == (config, ["train"])
    gpus(monkeypatch, 4)
    assert fit_to_devices(config, ["train"]) == (config, ["train"])


def test_the_demo_runs_on_one_gpu_with_its_global_batch(monkeypatch, capsys):
    gpus(monkeypatch, 1)
    config = train_config(["--config", "demo"])
    assert (config.parallel.nproc_per_node, config.training.global_batch_size) == (2, 16)
    fitted, argv = fit_to_devices(config, ["train", "--config", "demo"])
    assert fitted.parallel.nproc_per_node == 1 and fitted.training.global_batch_size == 16
    assert argv == ["train", "--config", "demo", "--nproc-per-node", "1", "--global-batch-size", "16"]
    assert validate(fitted, 1).num_micro_batches == 2
    assert capsys.readouterr().err == (
        "note: the recipe asks for 2 processes and this machine has 1 GPU visible (CUDA_VISIBLE_DEVICES honoured): "
        "running 1, 2 micro-batches per step for the same global batch of 16 (--distributed-backend gloo runs 2 on "
        "the CPU)\n"
    )


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_derived_global_batch_is_kept_per_node(monkeypatch, tmp_path, capsys):
    gpus(monkeypatch, 2)
    yaml = "parallel: {nproc_per_node: 4, nnodes: 2, master_addr: h}\ntraining: {micro_batch_size: 2}\n"
    argv = ["--config", recipe(tmp_path, yaml), "--mock-data"]
    fitted, worker_argv = fit_to_devices(train_config(argv), ["train", *argv])
    assert worker_argv[-4:] == ["--nproc-per-node", "2", "--global-batch-size", "16"]  # 2 x 4 x 2 nodes
    assert validate(fitted, 4).num_micro_batches == 2
    assert "asks for 4 processes per node and this machine has 2 GPUs visible" in capsys.readouterr().err


def test_a_recipe_that_cannot_shrink_says_why(monkeypatch, tmp_path):
    gpus(monkeypatch, 1)
    yaml = "parallel: {nproc_per_node: 2, tensor_model_parallel_size: 2}\ntraining: {global_batch_size: 8}\n"
    argv = ["--config", recipe(tmp_path, yaml), "--mock-data"]
    with pytest.raises(ConfigError) as caught:
        fit_to_devices(train_config(argv), ["train", *argv])
    message = str(caught.value)
    assert message.startswith("the recipe asks for 2 processes and this machine has 1 GPU visible")
    assert "choose a layout for --nproc-per-node 1, or use --distributed-backend gloo" in message
    assert "\n" not in message


def test_one_process_trains_with_the_fitted_settings(monkeypatch, tmp_path, capsys):
    """One process trains in the launching one: it gets the fitted settings, the recipe's global batch
    (4 processes x 2) kept through 4 micro-batches."""
    gpus(monkeypatch, 1)
    argv = ["--config", recipe(tmp_path, "parallel: {nproc_per_node: 4}\ntraining: {micro_batch_size: 2}\n")]
    launched, config, _ = launching.check_and_launch(
        train_config([*argv, "--mock-data"]), ["train", *argv, "--mock-data"]
    )
    assert launched is None
    assert (config.parallel.nproc_per_node, config.training.global_batch_size) == (1, 8)
    assert "running 1, 4 micro-batches per step for the same global batch of 8" in capsys.readouterr().err
