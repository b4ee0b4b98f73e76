"""Megatron-LM's own launch scripts run with `paratron train` in place of pretrain_gpt.py.

Test data (tests/data/megatron): Megatron-LM's GPT-3 example and 15 of its GPT functional-test
configurations at core_v0.16.1, and (tests/data/megatron/main) Megatron-LM main's GPT-3, Llama 3 fp8
and Mixtral examples and a DeepSeek-style MoE functional test, shrunk in sizes, paths and data only
(each file's header says what); a tiny GPT-2 BPE vocabulary and a corpus tokenized with it stand in
for the Pile. The launch scripts are run by bash (with `torchrun` stood in for), so paratron sees the
command line Megatron-LM would. Every flag they carry must stay accepted, but for those REMOVED names
in one place with the reason and the line paratron refuses them with.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from paratron.cli import main
from paratron.commands.train import train_config
from paratron.config import validate
from paratron.distributed.local_ranks import run_ranks
from paratron.errors import ConfigError
from paratron.parallel.fp8 import check_fp8

DATA = Path(__file__).resolve().parents[1] / "data" / "megatron"
FUNCTIONAL = sorted((DATA / "functional").glob("*.yaml"))
EXAMPLE = DATA / "train_gpt3_175b_distributed.sh"
WORLD = 4
VOCAB, MERGES = DATA / "gpt2-tiny-vocab.json", DATA / "gpt2-tiny-merges.txt"
CORPUS = DATA / "stdlib_tiny_text_document"
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

MAIN = DATA / "main"
"""Megatron-LM main's example scripts and a DeepSeek-style functional test, shrunk (each file's header says how)."""
MAIN_SCRIPTS = {path.stem: path for path in sorted(MAIN.glob("*.sh"))}
MAIN_FUNCTIONAL = {path.stem: path for path in sorted(MAIN.glob("*.yaml"))}


def bash_argv(path: Path, root: Path) -> list[str]:
    """The command line a launch script hands pretrain_gpt.py, built by bash itself (`torchrun` stood in for by a
    function that prints its arguments), with the tiny vocabulary, corpus and this run's folders as its arguments."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pretrain_gpt.py").touch()  # (the Llama example checks that it runs from Megatron-LM's folder)
    positional = {
        "train_gpt3_175b_distributed": [root / "checkpoints", root / "tensorboard", VOCAB, MERGES, CORPUS],
        "train_llama3_8b_h100_fp8": [root / "checkpoints/llama3", root / "tensorboard/llama3"],  # (MOCK data)
        "train_mixtral_8x7b_distributed": [root / "checkpoints", VOCAB, CORPUS, MERGES],
    }[path.stem]
    shim = 'torchrun() { printf "%s\\0" "$@"; }; source "$0" "$@"'
    done = subprocess.run(
        ["bash", "-c", shim, str(path), *map(str, positional)], cwd=root, capture_output=True, check=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root)},
    )  # fmt: skip
    words = done.stdout.decode().split("\0")[:-1]
    return _platform(words[words.index("pretrain_gpt.py") + 1 :])


_FP8 = "paratron's fp8 training is torchao's float8 layers"
_NO_FP8_MATMULS = "this device (cpu) has no fp8 matmuls"
_GATHER_ALONE = "--fp8-param-gather gathers fp8 weights; add --fp8-format"
_HARDWARE = "fp8 runs on Hopper or Blackwell tensor cores only"
REMOVED: dict[str, dict[str, tuple[str, str, str | None]]] = {
    # script -> {flag: (why it goes, what paratron's one-line refusal says, the value put in its place or None)}.
    # The test sees each refused with that line before taking it out (with its values), so a flag or value that
    # paratron comes to take fails the test until its entry here goes.
    "train_llama3_8b_h100_fp8": {
        "--fp8-format": (_HARDWARE, _NO_FP8_MATMULS, None),
        "--fp8-amax-history-len": (_HARDWARE, _FP8, None),
        "--fp8-amax-compute-algo": (_HARDWARE, _FP8, None),
        "--fp8-param-gather": (_HARDWARE, _GATHER_ALONE, None),
    },
    "deepseek_proxy_fsdp_ep2_fsdp2": {
        "--fp8-format": (_HARDWARE, "--fp8-format e4m3 runs inside bf16 training (this run is fp32)", None),
        "--fp8-param-gather": (_HARDWARE, _GATHER_ALONE, None),
        "--outer-dp-sharding-strategy": ("hybrid FSDP is not implemented", "hybrid sharding", None),
        "--moe-router-dtype": ("the router's precision", "the router's precision is not selectable", None),
        "--moe-router-pre-softmax": (
            "Megatron-LM ignores it with a sigmoid score; paratron refuses the pair",
            "applies to --moe-router-score-function softmax only",
            None,
        ),
    },
}
"""What Megatron-LM main's scripts carry that paratron refuses (or reads otherwise), in one place."""


def _without(argv: list[str], flag: str, value: str | None = None) -> list[str]:
    """`argv` without `flag` and its values (or with `value` in their place)."""
    if flag not in argv:
        return argv
    start = argv.index(flag)
    end = start + 1
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return argv[:start] + ([flag, value] if value is not None else []) + argv[end:]


def main_argv(name: str, root: Path, check: bool = False) -> list[str]:
    """A script of Megatron-LM main as paratron trains it: REMOVED's flags taken out (with `check`, each seen
    refused first with its line, the others already gone)."""
    argv = bash_argv(MAIN_SCRIPTS[name], root) if name in MAIN_SCRIPTS else functional_argv(MAIN_FUNCTIONAL[name], root)
    removed = REMOVED.get(name, {})
    for flag, (_, refusal, _value) in removed.items() if check else ():
        assert flag in argv, f"{name}: {flag} is no longer in the script; drop it from REMOVED"
        alone = argv
        for other, (_, _, other_value) in removed.items():
            alone = alone if other == flag else _without(alone, other, other_value)
        with pytest.raises(ConfigError) as error:
            config = train_config(alone)
            validate(config, WORLD)
            check_fp8(config.training, "cpu")  # (what `paratron train` asks of the device before any process starts)
        assert refusal in str(error.value) and "\n" not in str(error.value), (flag, str(error.value))
    for flag, (_, _, value) in removed.items():
        argv = _without(argv, flag, value)
    return argv


def _argv(name: str, root: Path) -> list[str]:
    if name in MAIN_SCRIPTS or name in MAIN_FUNCTIONAL:
        return main_argv(name, root)
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


@pytest.mark.parametrize("name", [*MAIN_SCRIPTS, *MAIN_FUNCTIONAL])
def test_megatron_mains_scripts_are_accepted_but_for_what_is_named(name, tmp_path, capsys):
    config = _config(main_argv(name, tmp_path, check=True))
    layout = validate(config, WORLD)
    assert layout.tp * layout.pp * layout.cp * layout.dp == WORLD
    if name in MAIN_SCRIPTS:  # (--load is --save and holds nothing yet: start from scratch, warned)
        assert config.checkpoint.load is None and "holds no checkpoint yet" in capsys.readouterr().err
    if name == "train_gpt3_175b_distributed":  # (the step schedule, in tokens of --seq-length 64)
        assert config.training.step_schedule_text() == "0:2 0.128K:4 0.384K:6 0.768K:8"
        assert config.training.global_batch_size == 8
    if name == "deepseek_proxy_fsdp_ep2_fsdp2":
        assert (config.model.num_experts, config.parallel.expert_model_parallel_size, layout.dp) == (4, 2, 4)
        m = config.model  # (DeepSeek-V3's MoE: a dense first layer, sigmoid scores, group-limited routing)
        assert m.moe_layer_pattern == (False, True, True, True)
        assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_score_function) == (2, 1, "sigmoid")
        assert (m.multi_latent_attention, m.q_lora_rank, m.rope_type) == (True, 32, "yarn")  # (and its attention)
        assert config.checkpoint.ckpt_format == "fsdp_dtensor"


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
    import multiprocessing

    # the Llama 3 example's --num-workers 1 starts data-loader workers, which a daemonic test rank may not have
    multiprocessing.current_process()._config["daemon"] = False
    dist.init_process_group("gloo")
    results = {}
    try:
        for name in ["gpt3_example", *SCRIPTS, *MAIN_SCRIPTS, *MAIN_FUNCTIONAL]:
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
