"""The embedded corpus: the Python standard library's own source, located with `sysconfig`,
so every machine that runs paratron has it without a download."""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from collections.abc import Iterable
from pathlib import Path

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_files() -> list[Path]:
    """The standard library's own modules: its .py files minus test suites and installed packages,
    in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIPPED_DIRS & set(p.relative_to(root).parts) and p.is_file()]
    return shuffled_by_name(files, root)


def shuffled_by_name(files: Iterable[Path], root: Path) -> list[Path]:
    """Order files by a hash of their relative path: fixed on every machine, and mixed, so a
    contiguous validation split samples the whole corpus rather than its last folders."""

    def key(p: Path) -> str:
        return hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()

    return sorted(files, key=key)


def files_signature(files: Iterable[Path]) -> str:
    """Hash of the file list with sizes and modification times: changes when the corpus does."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


INSTRUCTION = "Write the Python function whose docstring is:\n{docstring}"


def docstring_instructions(path: Path, max_docstring: int, max_source: int) -> list[dict[str, str]]:
    """Instruction pairs from one module of the corpus (the fine-tuning demo's and benchmark's data):
    {"prompt": "Write the Python function whose docstring is: ...", "completion": its source},
    for every function whose docstring and source are at most these many characters."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        docstring = ast.get_docstring(node)
        code = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).rstrip("\n")
        if docstring and len(docstring) <= max_docstring and len(code) <= max_source:
            pairs.append({"prompt": INSTRUCTION.format(docstring=docstring), "completion": code})
    return pairs
