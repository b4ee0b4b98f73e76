"""The package's layers: imports point one way (docs/architecture.md), and no import hides
inside a function unless it is there for start-up speed and says so."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "paratron"
LAYERS = [
    "errors",
    "storage",
    "config",
    "distributed",
    "model",
    "parallel",
    "optim",
    "data",
    "checkpoint",
    "debugging",
    "inference",
    "training",
    "planning",
    "commands",
    "cli",
    "megatron_api",
]
"""Top-level modules and subpackages, each allowed to import only from itself and earlier ones."""


def _modules() -> dict[str, tuple[ast.Module, list[str]]]:
    """Every module of the package by name: its syntax tree and its lines."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(("paratron", *path.relative_to(PACKAGE).with_suffix("").parts))
        source = path.read_text(encoding="utf-8")
        out[name.removesuffix(".__init__")] = (ast.parse(source), source.splitlines())
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module]
    return []


def test_imports_point_one_way():
    upward = []
    for module, (tree, _) in _modules().items():
        own = _layer(module)
        for node in ast.walk(tree):
            for target in _imported(node):
                theirs = _layer(target) if target.startswith("paratron.") else None
                if own is not None and theirs is not None and theirs > own:
                    upward.append(f"{module} imports {target}")
    assert not upward, "imports against the layer order of docs/architecture.md:\n" + "\n".join(upward)


def test_function_level_imports_are_only_for_start_up_speed():
    hidden = []
    for module, (tree, lines) in _modules().items():
        says_so = "start-up speed" in (ast.get_docstring(tree) or "")
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    near = " ".join(lines[function.lineno - 1 : node.end_lineno])  # the function up to it
                    if not (says_so or "start-up speed" in near or "not on Windows" in near):
                        hidden.append(f"{module}:{node.lineno}")
    assert not hidden, "imports inside functions that do not say why:\n" + "\n".join(hidden)
