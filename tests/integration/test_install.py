"""paratron as people install it: a wheel built from the checkout, installed into a fresh virtual
environment that cannot see the checkout, serves the documented commands from any folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from paratron.config.loading import available_recipes, find_recipe
from paratron.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "paratron"
SHIPPED_RECIPES = sorted(p.stem for p in (PACKAGE / "recipes").glob("*.yaml"))

PROBE = """
import json, paratron
from paratron.config.loading import available_recipes, build_config, find_recipe
names = available_recipes()
print(json.dumps({
    "module": paratron.__file__,
    "recipes": {name: str(find_recipe(name)) for name in names},
    "run_dirs": {name: build_config(recipe=name).logging.run_dir for name in names},
}))
"""
"""Run by the fresh environment's Python: where paratron and its recipes come from, each recipe read."""


def _package_data() -> list[str]:
    """Every file of the package that is not Python source: what the code reads at run time."""
    return sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the wheel, the fresh environment, the environment to run it in) built from a copy of the sources."""
    root = tmp_path_factory.mktemp("install")
    sources = root / "sources"
    sources.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, sources / name)
    shutil.copytree(REPO / "src", sources / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONUNBUFFERED="1")
    pip = [sys.executable, "-m", "pip"]
    wheels = root / "wheels"
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheels), str(sources)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("paratron-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        env=env,
        timeout=120,
    )
    # torch and the other dependencies come from this interpreter's site-packages, added as plain
    # path lines: the .pth files in there (such as an editable install's pointer to src/) do not run.
    purelib = subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    ours = dict.fromkeys(sysconfig.get_path(kind) for kind in ("purelib", "platlib"))
    (Path(purelib.decode().strip()) / "dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    return wheel, venv, env


def paratron(installed: tuple[Path, Path, dict[str, str]], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The installed `paratron` console script, run from `cwd`."""
    _, venv, env = installed
    return subprocess.run(
        [str(venv / "bin" / "paratron"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_wheel_carries_every_file_the_package_reads(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    data = _package_data()
    assert "paratron/config/megatron_flags.txt" in data
    assert {f"paratron/recipes/{name}.yaml" for name in ("debug", "demo", "finetune-demo")} <= set(data)
    assert sorted(set(data) - names) == []


def test_installed_wheel_serves_the_documented_commands_from_any_folder(installed, tmp_path):
    _, venv, env = installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert REPO not in elsewhere.parents

    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert Path(found["module"]).is_relative_to(venv), found["module"]  # the wheel's copy, not the checkout
    assert sorted(found["recipes"]) == SHIPPED_RECIPES
    assert all(Path(path).is_relative_to(venv) for path in found["recipes"].values()), found["recipes"]
    assert found["run_dirs"] == {name: f"runs/{name}" for name in SHIPPED_RECIPES}  # each YAML read

    usage = paratron(installed, elsewhere, "--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: paratron COMMAND"), usage.stderr

    missing = one_line_error(paratron(installed, elsewhere, "train", "--config", "nosuch"))
    assert f"recipes: {', '.join(SHIPPED_RECIPES)};" in missing, missing

    megatron_only = one_line_error(paratron(installed, elsewhere, "train", "--config", "debug", "--dino-teacher-temp"))
    assert "--dino-teacher-temp is a Megatron-LM flag that paratron does not implement" in megatron_only  # flag list

    run = elsewhere / "run"
    quiet = ["--no-tensorboard", "--no-progress-bar", "--log-interval", "1", "--lr-warmup-iters", "1"]
    trained = paratron(
        installed, elsewhere, "train", "--config", "debug", "--train-iters", "2", *quiet, "--run-dir", str(run)
    )
    assert trained.returncode == 0, trained.stdout + trained.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]

    planned = paratron(installed, elsewhere, "train", "--config", "demo", "--dry-run", "--world-size", "2")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "world 2 = TP 1 x CP 1 x DP 2" in planned.stdout
    assert "8 x 128 tokens per rank" in planned.stdout  # the demo recipe's micro-batch and sequence length


def test_own_recipes_in_the_configs_folder_come_before_the_shipped_ones(tmp_path, monkeypatch):
    own = tmp_path / "configs"
    own.mkdir()
    (own / "debug.yaml").write_text("training:\n  train_iters: 3\n")
    (own / "mine.yaml").write_text("model:\n  model_name: debug\n")
    monkeypatch.chdir(tmp_path)
    assert available_recipes() == sorted({*SHIPPED_RECIPES, "mine"})
    assert find_recipe("debug") == own / "debug.yaml"
    assert find_recipe("demo") == PACKAGE / "recipes" / "demo.yaml"
    with pytest.raises(
        ConfigError, match=r"--config nosuch: no such file or recipe; recipes: debug, demo, finetune-demo, mine; "
    ):
        find_recipe("nosuch")
