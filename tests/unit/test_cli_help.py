"""What each command's --help shows and accepts, the unknown-command hint and --version, all in
process: `paratron.cli.main` with captured output."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import tomllib

from paratron.cli import main
from paratron.commands.evaluate import parser as evaluate_parser
from paratron.commands.plan import parser as plan_parser
from paratron.config.arguments import parse_config_arguments

OPTION = re.compile(r"^  (-[-\w]+)(?: ([^\s,]+(?: \[[^\]]+\])?))?", re.MULTILINE)
"""An option at the start of a help line, with its metavar (argparse's layout)."""


@pytest.fixture(autouse=True)
def _eighty_columns(monkeypatch):
    """argparse wraps help to the terminal's width: count lines at the usual 80 columns."""
    monkeypatch.setenv("COLUMNS", "80")


def help_of(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        main([*command, "--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def listed(text: str) -> list[str]:
    return [m.group(1) for m in OPTION.finditer(text) if m.group(1) != "-h"]


def accepts_each(parser, options: list[str]) -> None:
    """Every listed option parses with a value of its kind."""
    actions = parser._option_string_actions
    for option in options:
        action = actions[option]
        if action.nargs == 0:
            argv = [option]
        else:
            argv = [option, str(action.choices[0]) if action.choices else "1"]
        if option == "--config":
            argv = ["--config", "debug"]
        _, _, namespace = parse_config_arguments(parser, argv)
        assert action.dest in vars(namespace), option


def test_evaluate_lists_only_what_it_uses_grouped_as_train(capsys):
    text = help_of(capsys, "evaluate")
    lines = text.splitlines()
    assert len(lines) < 265, len(lines)  # (a budget: one screenful per group, not the whole of train)
    options = listed(text)
    for needed in ("--load", "--ckpt-format", "--data-path", "--tokenizer-model", "--sft", "--chat-template",
                   "--seq-length", "--micro-batch-size", "--global-batch-size", "--nproc-per-node",
                   "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--precision",
                   "--distributed-backend", "--output"):  # fmt: skip
        assert needed in options, needed
    for absent in ("--hidden-size", "--num-layers", "--model-name", "--swiglu", "--lr", "--train-iters", "--save"):
        assert absent not in options, absent
    titles = [line for line in lines if line.endswith(" settings:")]
    assert titles == ["parallel settings:", "data settings:", "training settings:", "checkpoint settings:"]
    train_titles = [line for line in help_of(capsys, "train").splitlines() if line.endswith(" settings:")]
    assert set(titles) < set(train_titles)


def test_evaluate_accepts_every_flag_it_lists(capsys):
    options = listed(help_of(capsys, "evaluate"))
    accepts_each(evaluate_parser(), options)
    _, overrides, namespace = parse_config_arguments(evaluate_parser(), ["--load", "c", "--output", "o.json"])
    assert overrides == {"load": "c"} and namespace.output == Path("o.json")


def test_plan_lists_the_model_batch_data_and_machine_not_the_layout(capsys):
    text = help_of(capsys, "plan")
    lines = text.splitlines()
    assert len(lines) < len(help_of(capsys, "train").splitlines()) / 3, len(lines)
    options = listed(text)
    for needed in ("--model-name", "--hidden-size", "--num-layers", "--global-batch-size", "--seq-length",
                   "--precision", "--bf16", "--data-path", "--tokenizer-type", "--mock-data", "--hardware",
                   "--nodes", "--gpus-per-node", "--output", "--qk-layernorm", "--add-qkv-bias", "--hidden-dropout",
                   "--make-vocab-size-divisible-by", "--sgd-momentum", "--moe-shared-expert-gate"):  # fmt: skip
        assert needed in options, needed
    for absent in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                   "--zero-stage", "--recompute-granularity", "--nproc-per-node", "--lr"):  # fmt: skip
        assert absent not in options, absent
    titles = [line for line in lines if line.endswith(" settings:")]
    assert titles[0] == "model settings:" and "data settings:" in titles and "planning settings:" in titles
    accepts_each(plan_parser(), options)


@pytest.mark.parametrize(
    "command, given, message",
    [
        (
            ["evaluate", "--load", "ckpt", "--data-path", "x"],
            ["--hidden-size", "64"],
            "--hidden-size: paratron evaluate takes the model from the checkpoint (--load); drop the model flags "
            "(`paratron evaluate --help` lists the flags it takes)",
        ),
        (
            ["evaluate", "--load", "ckpt"],
            ["--swiglu"],
            "--swiglu: paratron evaluate takes the model from the checkpoint (--load)",
        ),
        (["evaluate", "--load", "ckpt"], ["--lr", "1"], "--lr: paratron evaluate does not use this setting of"),
        (
            ["plan", "--model", "debug", "--global-batch-size", "8"],
            ["--tensor-model-parallel-size", "2"],
            "--tensor-model-parallel-size: paratron plan chooses the layout itself (each plan sets it); drop it",
        ),
        (["plan", "--model", "debug"], ["--nproc", "2"], "--nproc: paratron plan counts the devices from --nodes"),
        (
            ["plan", "--model", "debug"],
            ["--train-iters", "5"],
            "--train-iters: the plan does not depend on it; add it to the printed paratron train command instead",
        ),
    ],
)
def test_flags_a_command_does_not_take_are_one_line(capsys, command, given, message):
    assert main([*command, *given]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.parametrize("command", ["generate", "convert", "schedule"])
def test_options_name_their_values(capsys, command):
    text = help_of(capsys, command)
    for match in OPTION.finditer(text):
        option, metavar = match.group(1), match.group(2)
        if option == "-h":
            continue
        if metavar is not None:
            assert metavar.split()[0] != option[2:].replace("-", "_").upper(), match.group(0)
    if command == "generate":
        shown = {m.group(1): m.group(2) for m in OPTION.finditer(text)}
        assert shown["--prompt"] == "TEXT" and shown["--prompt-file"] == "FILE" and shown["--max-new-tokens"] == "N"
        sampling = ("--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--stop", "--n", "--logprobs")
        assert all(shown[o] for o in (*sampling, "--chat-template", "--load", "--kv-cache-gb"))
        assert shown["--chat"] is None and "--tensor-model-parallel-size" in shown and "--hidden-size" not in shown


def test_a_mistyped_command_gets_the_nearest(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown command 'trian'; did you mean train? commands: train, evaluate")
    assert main(["zzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_version_installed_or_from_the_source_tree(capsys, monkeypatch):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"paratron {importlib.metadata.version('paratron')}\n"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    project = Path(__file__).resolve().parents[2] / "pyproject.toml"
    expected = tomllib.loads(project.read_text(encoding="utf-8"))["project"]["version"]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"paratron {expected}\n"
