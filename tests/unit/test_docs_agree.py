"""The documents list what the code has: the commands, the named model sizes, the Hugging Face
families, the hardware presets and the recipes, each compared with the registry it describes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import paratron.checkpoint.hf as hf
from paratron.checkpoint.pretrained import load_pretrained
from paratron.cli import COMMANDS, main
from paratron.config.loading import available_recipes, build_config
from paratron.config.presets import MODELS
from paratron.model.registry import count_active_parameters, count_parameters
from paratron.planning.dry_run import with_vocabulary
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


def millions(count: int) -> str:
    """A parameter count as the README's model table writes it: 0.38M, 8,030.3M."""
    return f"{count / 1e6:,.2f}M" if count < 1e6 else f"{count / 1e6:,.1f}M"


def parameters_cell(name: str) -> str:
    """The README's parameters of `--model NAME`, from the code: the model `--model NAME --mock-data` builds
    (with mock data's vocabulary where the entry has none, and then a shipped recipe's too), its active
    parameters where it has experts."""
    model = with_vocabulary(build_config({"model_name": name, "mock_data": True})).model
    notes = []
    if MODELS[name].get("vocab_size") is None:
        notes.append(f"vocab {model.vocab_size:,} of `--mock-data`")
        for recipe in available_recipes():
            ran = with_vocabulary(build_config({}, recipe)).model
            if ran.model_name == name and ran.vocab_size != model.vocab_size:
                notes.append(f"{millions(count_parameters(ran))} with the `{recipe}` recipe's vocab {ran.vocab_size:,}")
    if model.num_experts:
        notes.append(f"{millions(count_active_parameters(model))} active")
    return millions(count_parameters(model)) + (f" ({'; '.join(notes)})" if notes else "")


def test_the_readme_model_table_gives_the_parameters_the_code_builds():
    after = README[README.index("### Named model sizes") :]
    rows = re.search(r"\n(\|.*\|\n\|[-| :]+\|\n(?:\|.*\|\n)+)", after).group(1).splitlines()[2:]
    cells = {re.match(r"\| `([^`]+)`", row).group(1): row.split(" | ")[1] for row in rows}
    expected = {name: parameters_cell(name) for name in MODELS}
    assert cells == expected
