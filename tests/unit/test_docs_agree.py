"""The documents list what the code has: the commands, the named model sizes, the Hugging Face
families, the hardware presets and the recipes, each compared with the registry it describes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import paratron.checkpoint.hf as hf
from paratron.checkpoint.pretrained import load_pretrained
from paratron.cli import COMMANDS, main
from paratron.config.loading import available_recipes
from paratron.config.presets import MODELS
from paratron.planning.hardware import preset_names

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")


def table_keys(text: str, heading: str) -> list[str]:
    """The first column's `code` entries of the first table after `heading`."""
    after = text[text.index(heading) :]
    rows = re.search(r"\n(\|.*\|\n\|[-| :]+\|\n(?:\|.*\|\n)+)", after).group(1).splitlines()[2:]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def test_the_readme_lists_every_command():
    assert table_keys(README, "## Using paratron") == [f"paratron {name}" for name in COMMANDS]


def test_the_readme_lists_every_named_model_size():
    assert sorted(table_keys(README, "### Named model sizes")) == sorted(MODELS)


def test_the_planning_guide_lists_every_hardware_preset():
    planning = (REPO / "docs" / "planning.md").read_text(encoding="utf-8")
    assert sorted(table_keys(planning, "### Hardware")) == sorted(preset_names())


def test_the_readme_names_every_shipped_recipe():
    shipped = re.search(r"The recipes \(([^)]*)\) are package data", README).group(1)
    assert re.findall(r"`([\w-]+)`", shipped) == available_recipes()


@pytest.mark.parametrize(
    "where, text",
    [
        ("README.md", README),
        ("docs/training.md", (REPO / "docs" / "training.md").read_text(encoding="utf-8")),
        ("paratron.checkpoint.hf's docstring", hf.__doc__),
        ("load_pretrained's docstring", load_pretrained.__doc__),
    ],
)
def test_every_hugging_face_family_is_named(where, text):
    missing = [
        name for name in hf.FAMILY_NAMES.values() if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
    ]
    assert not missing, f"{where} does not name {missing}"


def test_every_supported_model_type_has_its_name():
    assert sorted(hf.FAMILY_NAMES) == sorted(hf.ARCHITECTURES)


def test_convert_help_names_every_hugging_face_family(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in hf.FAMILY_NAMES.values()), text


def test_the_architecture_page_names_every_module():
    """Walks the package as it is, so a module added anywhere under src/paratron needs its line."""
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w./]+)`", page))
    package = REPO / "src" / "paratron"
    modules = [path for path in package.rglob("*.py") if path.name != "__init__.py"]
    folders = [path for path in package.rglob("*") if path.is_dir() and (path / "__init__.py").is_file()]
    wanted = [path.relative_to(package).as_posix() for path in modules]
    wanted += [path.relative_to(package).as_posix() + "/" for path in folders if path != package]
    missing = sorted(name for name in wanted if name not in named and "__pycache__" not in name)
    assert not missing, f"docs/architecture.md's module map does not name {missing}"
