"""Megatron-LM's own launch scripts run with `paratron train` in place of pretrain_gpt.py.

Test data (tests/data/megatron): Megatron-LM's GPT-3 example and 15 of its GPT functional-test
configurations at core_v0.16.1, shrunk in sizes, paths and data only; a tiny GPT-2 BPE vocabulary
and a corpus tokenized with it stand in for the Pile. Every flag they carry must stay accepted.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from paratron.cli import main, train_config
from paratron.config import validate
from paratron.distributed.local_ranks import run_ranks

DATA = Path(__file__).resolve().parents[1] / "data" / "megatron"
FUNCTIONAL = sorted((DATA / "functional").glob("*.yaml"))
EXAMPLE = DATA / "train_gpt3_175b_distributed.sh"
WORLD = 4
"""Processes the scripts run on here (their TP x PP x CP divides it; data parallelism takes the rest)."""


def _fill(token: str, paths: dict[str, str]) -> str:
    for name, value in paths.items():
        token = token.replace("${" + name + "}", value).replace("$" + name, value)
    return token


def _platform(argv: list[str]) -> list[str]:
    """NCCL needs GPUs: on a machine without CUDA the scripts' --distributed-backend nccl becomes gloo."""
    if torch.cuda.is_available():
        return argv
    return ["gloo" if a == "nccl" and i and argv[i - 1] == "--distributed-backend" else a for i, a in enumerate(argv)]


def functional_argv(path: Path, root: Path) -> list[str]:
    """A functional-test configuration's MODEL_ARGS as the command line Megatron-LM's harness builds."""
    paths = {
        "DATA_PATH": str(DATA),
        "CHECKPOINT_SAVE_PATH": str(root / "checkpoints"),
        "CHECKPOINT_LOAD_PATH": str(root / "checkpoints"),
        "TENSORBOARD_PATH": str(root / "tensorboard"),
        "DATA_CACHE_PATH": str(root / "cache"),
    }
    argv: list[str] = []
    for flag, value in yaml.safe_load(path.read_text())["MODEL_ARGS"].items():
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, *str(value).split()]
    return _platform([_fill(token, paths) for token in argv])


def example_argv(root: Path) -> list[str]:
    """The GPT-3 example's flag arrays, with its positional paths filled in."""
    text = EXAMPLE.read_text()
    paths = {
        "CHECKPOINT_PATH": str(root / "checkpoints"),
        "TENSORBOARD_LOGS_PATH": str(root / "tensorboard"),
        "VOCAB_FILE": str(DATA / "gpt2-tiny-vocab.json"),
        "MERGE_FILE": str(DATA / "gpt2-tiny-merges.txt"),
        "DATA_PATH": str(DATA / "stdlib_tiny_text_document"),
    }
    argv: list[str] = []
    for name in ("GPT_MODEL_ARGS", "TRAINING_ARGS", "MODEL_PARALLEL_ARGS", "DATA_ARGS", "EVAL_AND_LOGGING_ARGS"):
        body = re.search(rf"^{name}=\(\n(.*?)^\)", text, re.S | re.M)
        assert body is not None, f"{name} is missing from {EXAMPLE.name}"
        for line in body.group(1).splitlines():
            argv += line.split("#")[0].split()
    return _platform([_fill(token, paths) for token in argv])


SCRIPTS = {path.stem: path for path in FUNCTIONAL}


def _argv(name: str, root: Path) -> list[str]:
    return example_argv(root) if name == "gpt3_example" else functional_argv(SCRIPTS[name], root)


def _config(argv: list[str]):
    return train_config(argv)


def test_the_test_data_holds_the_example_and_ten_functional_tests():
    assert EXAMPLE.is_file() and len(FUNCTIONAL) >= 10


@pytest.mark.parametrize("name", ["gpt3_example", *SCRIPTS])
def test_every_flag_of_the_scripts_is_accepted(name, tmp_path, capsys):
    config = _config(_argv(name, tmp_path))
    layout = validate(config, WORLD)
    assert layout.tp * layout.pp * layout.cp * layout.dp == WORLD
    assert config.checkpoint.load is None  # --load is --save and holds nothing yet: start from scratch, warned
    assert "holds no checkpoint yet" in capsys.readouterr().err


def test_the_scripts_train_what_megatron_trains(tmp_path, capsys):
    example = _config(example_argv(tmp_path))
    assert (example.data.resolved_tokenizer_type, example.training.precision) == ("GPT2BPETokenizer", "fp16")
    assert (example.model.hidden_dropout, example.model.attention_dropout, example.optimizer.adam_beta2) == (
        0.1,
        0.1,
        0.95,
    )
    llama = _config(functional_argv(SCRIPTS["gpt3_mcore_reruns_disable"], tmp_path))
    assert (llama.model.num_query_groups, llama.model.ffn_hidden_size, llama.parallel.sequence_parallel) == (
        2,
        128,
        False,
    )
    assert "--sequence-parallel needs --tensor-model-parallel-size above 1; turned off" in capsys.readouterr().err
    swiglu = _config(functional_argv(SCRIPTS["gpt3_mcore_te_tp1_pp4_swiglu"], tmp_path))
    assert swiglu.model.ffn_hidden_size == int(4 * 64 * 2 / 3 / 64) * 64 == 128  # Megatron-LM's SwiGLU width


def _run_scripts(root: str) -> dict[str, tuple[int, list[float]]]:
    """On each of WORLD ranks: every script for 2 steps through `paratron train`'s own entry point."""
    dist.init_process_group("gloo")
    results = {}
    try:
        for name in ["gpt3_example", *SCRIPTS]:
            folder = Path(root) / name
            folder.mkdir(exist_ok=True)
            os.chdir(folder)  # (the scripts name no run directory: runs/latest here)
            code = main(["train", *_argv(name, folder), "--no-progress-bar"])
            metrics = folder / "runs" / "latest" / "metrics.jsonl"
            losses = [json.loads(line)["loss"] for line in open(metrics)] if metrics.exists() else []
            results[name] = (code, losses)
    finally:
        dist.destroy_process_group()
    return results


@pytest.mark.spawns
def test_the_scripts_train_two_steps(tmp_path):
    ranks = run_ranks(_run_scripts, WORLD, str(tmp_path), timeout=600)
    for name, (code, losses) in ranks[0].items():
        assert code == 0, f"{name}: paratron train exited with {code}"
        assert losses and all(math.isfinite(x) for x in losses), f"{name}: losses {losses}"
    assert all(code == 0 for rank in ranks[1:] for code, _ in rank.values())
