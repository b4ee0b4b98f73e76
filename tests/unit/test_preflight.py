"""The checks before launch run once each: `paratron train`'s command line resolved and checked in this process,
with every check function counted wherever it is called from (the workers' own start is left out)."""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import pkgutil
import sys
from collections.abc import Callable
from typing import Any

import pytest

import paratron.config.checks
import paratron.training.preflight
import paratron.training.run
from paratron.cli import main

ALSO_CHECKS = (
    ("paratron.config.validation", "validate"),
    ("paratron.parallel.fp8", "check_fp8"),
    ("paratron.training.profiling", "check_profile_settings"),
    ("paratron.training.metrics", "require_wandb"),
)
"""Checks that live beside what they check, outside the two packages of checks. (`config.faults.parse_faults`
is not counted: validation parses --fault-inject to check it, the fault injector to read it.)"""


def check_functions() -> dict[Callable[..., Any], str]:
    """Every check function, public or not, of `config.checks` and `training.preflight`, and `ALSO_CHECKS`."""
    modules = [paratron.config.checks, paratron.training.preflight]
    for package in list(modules):
        modules += [
            importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)
        ]
    found = {}
    for module in modules:
        for name, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__ == module.__name__ and "check" in name:
                found[value] = f"{module.__name__}.{name}"
    for module, name in ALSO_CHECKS:
        found[getattr(importlib.import_module(module), name)] = f"{module}.{name}"
    return found


def count_calls(monkeypatch: pytest.MonkeyPatch) -> tuple[collections.Counter, dict[Callable[..., Any], str]]:
    """Wrap each check function in every module of the package that holds it, counting its calls by name."""
    checks, calls = check_functions(), collections.Counter()

    def counted(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    wrappers = {fn: counted(fn, name) for fn, name in checks.items()}
    for module in [m for name, m in sys.modules.items() if name.startswith("paratron") and m is not None]:
        for attribute, value in list(vars(module).items()):
            if inspect.isfunction(value) and value in wrappers:
                monkeypatch.setattr(module, attribute, wrappers[value])
    return calls, checks


@pytest.mark.parametrize(
    "flags",
    [
        ["--config", "debug"],
        ["--config", "debug", "--no-mock-data", "--data-path", "CORPUS", "--profile", "--save", "SAVE"],
    ],
    ids=["mock-data", "text-files"],
)
def test_each_check_runs_once_before_launch(flags, tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one two three\n" * 50)
    argv = [{"CORPUS": str(corpus), "SAVE": str(tmp_path / "save")}.get(f, f) for f in flags]
    trained = []
    monkeypatch.setattr(
        paratron.training.run, "run_training", lambda config, layout: trained.append(config)
    )  # (the workers' part)
    calls, checks = count_calls(monkeypatch)
    assert main(["train", *argv, "--run-dir", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    assert len(trained) == 1
    assert {name: n for name, n in calls.items() if n > 1} == {}
    public = {name for name in checks.values() if not name.rsplit(".", 1)[1].startswith("_")}
    assert sorted(public - set(calls)) == []  # (every check ran: the count above means something)


def test_a_one_process_run_checks_nothing_again_once_it_starts(tmp_path, monkeypatch, capsys):
    """The worker's part (process group, data, model, training) repeats none of the checks made before launch."""
    calls, _ = count_calls(monkeypatch)
    run = ["--run-dir", str(tmp_path / "run"), "--no-progress-bar", "--no-tensorboard"]
    argv = ["train", "--config", "debug", "--train-iters", "1", "--eval-iters", "0", *run]
    assert main(argv) == 0, capsys.readouterr().err
    assert {name: n for name, n in calls.items() if n > 1} == {}
    assert calls["paratron.config.validation.validate"] == 1
