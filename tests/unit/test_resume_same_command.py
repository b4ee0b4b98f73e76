"""Resuming with the command that saved always works: for every spelling the flag tables accept (flags Megatron-LM
ignores, derived defaults given explicitly, recipes, presets, Megatron-LM's spellings), the settings resolved with
`--load` added agree with the checkpoint's, and build the same model.

In process, per command line: resolve it as `paratron train` does, build the model on the meta device, write the
checkpoint's settings as a save writes them (meta.json, the tracker), then resolve the same line with --load."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from paratron.checkpoint import model_of
from paratron.checkpoint.files import TRACKER
from paratron.cli import main
from paratron.commands.plan import run as run_plan
from paratron.commands.train import train_settings
from paratron.config import loading
from paratron.config.loading import config_to_dict, override
from paratron.config.schema import Config
from paratron.debugging.compare import resolve_run, same_model
from paratron.errors import ConfigError
from paratron.model.gpt import GPT
from paratron.planning.dry_run import with_vocabulary

TINY = "--mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2"
LLAMA = "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear"
BIG = "--mock-data --num-layers 1 --seq-length 32 --micro-batch-size 1"  # (a preset's width, one layer, on meta)

RECIPE = "model:\n  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n  num_query_groups: 2\n"
"""A recipe that sets num_query_groups alone (recipes may: grouped-query attention with 2 key/value heads)."""

COMMANDS: dict[str, str] = {
    # flags Megatron-LM ignores (with a warning) and so does paratron
    "llama-groups-without-switch": f"{TINY} {LLAMA} --num-query-groups 2",
    "groups-without-switch": f"{TINY} --num-query-groups 2",
    "one-group-without-switch": f"{TINY} --num-query-groups 1",
    "heads-as-groups-without-switch": f"{TINY} --num-query-groups 4",
    "rotary-percent-without-rope": f"{TINY} --rotary-percent 0.5",
    "rotary-interleaved-without-rope": f"{TINY} --rotary-interleaved",
    "rotary-base-without-rope": f"{TINY} --rotary-base 500000",
    "sequence-parallel-at-tp1": f"{TINY} --sequence-parallel",
    "router-topk-without-experts": f"{TINY} --moe-router-topk 4",
    "expert-width-without-experts": f"{TINY} --moe-ffn-hidden-size 128",
    "no-position-embedding-with-rope": f"{TINY} --position-embedding-type rope --no-position-embedding",
    "table-size-without-table": f"{TINY} --position-embedding-type rope --max-position-embeddings 4096",
    # derived defaults given explicitly
    "mlp-width-4h": f"{TINY} --ffn-hidden-size 256",
    "swiglu-width": f"{TINY} --swiglu --ffn-hidden-size 128",
    "head-width": f"{TINY} --kv-channels 16",
    "switch-alone": f"{TINY} --group-query-attention",
    "switch-and-one-group": f"{TINY} --group-query-attention --num-query-groups 1",
    "switch-and-groups": f"{TINY} {LLAMA} --group-query-attention --num-query-groups 2",
    "switch-and-heads-as-groups": f"{TINY} --num-query-groups 4 --group-query-attention",
    "mock-vocabulary": f"{TINY} --vocab-size 4096",
    "epsilon": f"{TINY} --norm-epsilon 1e-5",
    "rope-base": f"{TINY} --position-embedding-type rope --rotary-base 10000 --rotary-percent 1.0",
    "learned-table": f"{TINY} --position-embedding-type learned_absolute --max-position-embeddings 1024",
    "gelu": f"{TINY} --activation gelu --normalization LayerNorm",
    "biases": f"{TINY} --add-bias-linear",
    # Megatron-LM's spellings
    "megatron-llama": f"{TINY} --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--normalization RMSNorm --position-embedding-type rope --no-rope-fusion --group-query-attention "
    "--num-query-groups 2 --use-mcore-models --transformer-impl local --bf16",
    "megatron-gpt": f"{TINY} --openai-gelu --fp16 --use-distributed-optimizer --no-masked-softmax-fusion",
    "zero-centred-norms": f"{TINY} --apply-layernorm-1p --normalization RMSNorm",
    "qk-norms": f"{TINY} --qk-layernorm --add-qkv-bias",
    "partial-rotary": f"{TINY} --position-embedding-type rope --rotary-percent 0.5 --rotary-interleaved",
    "load-is-save": f"{TINY} {LLAMA} --num-query-groups 2 --load {{save}}",
    "load-is-save-checkpoint-args": f"{TINY} --num-query-groups 2 --use-checkpoint-args --load {{save}}",
    "load-is-save-switch": f"{TINY} --group-query-attention --num-query-groups 2 --load {{save}}",
    "experts": f"{TINY} --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64",
    "experts-every-other": f"{TINY} --num-experts 4 --moe-layer-freq 2 --moe-router-topk 1",
    "equals-spelling": f"{TINY} --num-query-groups=2 --hidden-size=64",
    # recipes and presets
    "recipe-debug": "--config debug",
    "recipe-debug-groups-without-switch": "--config debug --num-query-groups 2",
    "recipe-debug-switch": "--config debug --group-query-attention --num-query-groups 2",
    "recipe-debug-derived": "--config debug --ffn-hidden-size 256 --kv-channels 16 --max-position-embeddings 256",
    "preset-debug": "--model debug --mock-data --seq-length 32",
    "preset-debug-groups-without-switch": "--model debug --mock-data --seq-length 32 --num-query-groups 2",
    "preset-debug-moe": "--model debug-moe --mock-data --seq-length 32",
    "preset-llama": f"--model llama3-1b {BIG}",
    "preset-llama-groups-without-switch": f"--model llama3-1b {BIG} --num-query-groups 2",
    "preset-llama-preset-groups": f"--model llama3-1b {BIG} --num-query-groups 8",
    "preset-gpt2": f"--model gpt2-small {BIG}",
    "preset-mixtral": f"--model mixtral-8x7b {BIG}",
    "recipe-file-groups": "--config {recipe} --mock-data --seq-length 32",
    "recipe-file-groups-again-without-switch": "--config {recipe} --mock-data --seq-length 32 --num-query-groups 2",
    "recipe-file-groups-other-without-switch": "--config {recipe} --mock-data --seq-length 32 --num-query-groups 4",
}


def argv_of(name: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """The command line that saves into tmp_path/ckpt, and the one that resumes from there: the same with --load
    added, or the very same where it loads its --save folder from the start (Megatron-LM's scripts)."""
    recipe = tmp_path / "groups.yaml"
    recipe.write_text(RECIPE, encoding="utf-8")
    save = tmp_path / "ckpt"
    line = COMMANDS[name]
    argv = [*shlex.split(line.format(recipe=recipe, save=save)), "--save", str(save), "--train-iters", "4"]
    return argv, argv if "{save}" in line else [*argv, "--load", str(save)]


def shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """The model the settings build, as its parameters' shapes (on the meta device)."""
    with torch.device("meta"):
        model = GPT(config.model)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def write_settings(config: Config, save: Path, iteration: int = 2) -> None:
    """The checkpoint's settings as a save writes them: the run's config, its vocabulary worked out."""
    folder = save / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    meta = {"iteration": iteration, "consumed_samples": 0, "config": config_to_dict(config), "files": {}}
    (folder / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    (save / TRACKER).write_text(f"{iteration}\n", encoding="utf-8")


def test_the_corpus_is_large_and_names_each_kind():
    assert len(COMMANDS) >= 40
    assert sum("--num-query-groups" in line and "--group-query-attention" not in line for line in COMMANDS.values())
    assert sum(line.startswith("--config") for line in COMMANDS.values()) >= 5
    assert sum(line.startswith("--model") for line in COMMANDS.values()) >= 5


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_command_that_saved_resumes(name, tmp_path, capsys):
    argv, again = argv_of(name, tmp_path)
    first = train_settings(argv).config
    config = override(first, vocab_size=with_vocabulary(first).model.vocab_size)  # (as the run completes it)
    built = shapes(config)
    write_settings(config, tmp_path / "ckpt")
    resumed = train_settings(again)
    assert resumed.saved is not None, "the checkpoint's settings were not read"
    assert resumed.config.model.architecture() == config.model.architecture()
    assert shapes(override(resumed.config, vocab_size=config.model.vocab_size)) == built


def test_groups_without_the_switch_build_one_group_per_head_and_say_so_at_the_resume_too(tmp_path, capsys):
    argv, again = argv_of("llama-groups-without-switch", tmp_path)
    config = override(train_settings(argv).config, vocab_size=4096)
    assert (config.model.num_query_groups, config.model.group_query_attention) == (4, False)
    write_settings(config, tmp_path / "ckpt")
    capsys.readouterr()
    resumed = train_settings(again)
    assert resumed.config.model.num_query_groups == 4
    assert "warning: --num-query-groups 2 is ignored without --group-query-attention" in capsys.readouterr().err


def test_an_ignored_count_falls_back_to_the_recipes_and_the_checkpoints(tmp_path):
    """Ignored means as if not given: the recipe's 2 key/value heads stay, before and after the resume."""
    argv, again = argv_of("recipe-file-groups-other-without-switch", tmp_path)
    config = override(train_settings(argv).config, vocab_size=4096)
    assert config.model.num_query_groups == 2
    write_settings(config, tmp_path / "ckpt")
    assert train_settings(again).config.model.num_query_groups == 2


def test_a_resume_reads_its_recipe_and_its_checkpoint_once(tmp_path, monkeypatch):
    """One pass: the recipe and the checkpoint's settings are read once, an ignored count included."""
    argv, again = argv_of("recipe-file-groups-other-without-switch", tmp_path)
    write_settings(override(train_settings(argv).config, vocab_size=4096), tmp_path / "ckpt")
    reads: list[str] = []
    for module, name in ((loading, "read_yaml"), (model_of, "saved_model")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name: reads.append(name) or real(*a))
    assert train_settings(again).config.model.num_query_groups == 2
    assert sorted(reads) == ["read_yaml", "saved_model"]


def test_a_count_the_checkpoints_grouped_model_agrees_with_is_not_ignored(tmp_path, capsys):
    """Megatron-LM ignores --num-query-groups where the model has no grouped-query attention: a checkpoint whose
    model has it gives it to the run, so the count is compared with the checkpoint's, not dropped with a warning."""
    argv, _ = argv_of("switch-and-groups", tmp_path)
    write_settings(override(train_settings(argv).config, vocab_size=4096), tmp_path / "ckpt")
    capsys.readouterr()
    load = ["--load", str(tmp_path / "ckpt"), *shlex.split(TINY)]
    resumed = train_settings([*load, "--num-query-groups", "2"])
    assert (resumed.config.model.group_query_attention, resumed.config.model.num_query_groups) == (True, 2)
    assert "ignored" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--num-query-groups 1 contradicts the checkpoint .* \\(query groups 2\\)"):
        train_settings([*load, "--num-query-groups", "1"])


def test_debug_compare_sees_the_model_train_builds():
    """`paratron debug compare` resolves each run as train does: a count Megatron-LM ignores builds the same model,
    and a run that loads a checkpoint is the checkpoint's model."""
    plain = resolve_run(["--config", "debug", "--train-iters", "2"], "A")
    same_model(plain, resolve_run(["--config", "debug", "--train-iters", "2", "--num-query-groups", "2"], "B"))
    grouped = ["--config", "debug", "--train-iters", "2", "--group-query-attention", "--num-query-groups", "2"]
    with pytest.raises(ConfigError, match="the runs build different models: A has --no-group-query-attention"):
        same_model(plain, resolve_run(grouped, "B"))


def test_debug_compare_takes_the_model_of_the_checkpoint_a_run_loads(tmp_path):
    argv, _ = argv_of("switch-and-groups", tmp_path)
    config = override(train_settings(argv).config, vocab_size=4096)
    write_settings(config, tmp_path / "ckpt")
    loaded = resolve_run(["--mock-data", "--seq-length", "32", "--load", str(tmp_path / "ckpt")], "A")
    assert (loaded["model"]["num_query_groups"], loaded["model"]["activation"]) == (2, "swiglu")


def test_plan_plans_the_model_train_builds(tmp_path, capsys):
    """`paratron plan` counts the key/value heads train builds (one per query head when the count is ignored)."""
    argv = ["--model", "debug", "--gpus-per-node", "2", "--global-batch-size", "8", "--top", "1"]
    parameters = []
    for extra in ([], ["--num-query-groups", "2"]):
        assert run_plan([*argv, *extra, "--output", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")]) == 0
        plans = json.loads((tmp_path / "p.json").read_text())["plans"]
        parameters.append(plans[0]["memory_per_rank"][0]["parameters"])
    assert parameters[0] == parameters[1]
    assert "--num-query-groups 2 is ignored without --group-query-attention" not in capsys.readouterr().out


END_TO_END = ("llama-groups-without-switch", "recipe-debug-groups-without-switch", "preset-debug-moe", "load-is-save")
"""Representative lines run for real: the reported one, a recipe's, a preset's (its vocabulary left to the data) and
Megatron-LM's scripts' way (--save and --load the same folder from the start)."""


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.parametrize("name", END_TO_END)
def test_the_steps_after_the_resume_are_the_uninterrupted_runs(name, tmp_path, capsys):
    """4 steps straight; the same command that leaves at step 2 (--exit-interval 2, saving there), then again with
    --load: steps 3 and 4 equal the uninterrupted run's, exactly (one process, the same CPU kernels)."""
    argv, again = argv_of(name, tmp_path)
    save = str(tmp_path / "ckpt")
    straight = [t for i, t in enumerate(argv) if save not in argv[i : i + 2]]  # (no --save, no --load)
    assert save not in straight and "--save" not in straight and "--load" not in straight
    logged = ["--log-interval", "1", "--eval-iters", "0"]
    assert main(["train", *straight, *logged, "--run-dir", str(tmp_path / "straight")]) == 0
    assert main(["train", *argv, *logged, "--exit-interval", "2", "--run-dir", str(tmp_path / "first")]) == 0
    assert (tmp_path / "ckpt" / "iter_0000002" / "meta.json").is_file()
    assert main(["train", *again, *logged, "--exit-interval", "2", "--run-dir", str(tmp_path / "resumed")]) == 0
    straight, first, resumed = (losses(tmp_path / run) for run in ("straight", "first", "resumed"))
    assert sorted(straight) == [1, 2, 3, 4] and sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    assert {**first, **resumed} == straight
