"""Finding and reading text documents: user files and the embedded corpus.

The embedded corpus is the Python standard library's own source, located with
`sysconfig`, so every machine that runs paratron has it without a download.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from paratron.errors import DataError

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


def text_files(paths: Iterable[str]) -> list[Path]:
    """Expand files and directories (recursively, hidden entries skipped) into a sorted file list."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob("*") if p.is_file()
                              and not any(part.startswith(".") for part in p.relative_to(path).parts)))
        elif path.is_file():
            out.append(path)
        else:
            raise DataError(f"{path}: no such file or directory; check --data-path")
    if not out:
        raise DataError(f"--data-path {' '.join(paths)}: no files found")
    return out


def read_text(path: Path, strict: bool = True) -> str:
    """A file's text; bytes that are not UTF-8 are an error naming the offset (or replaced when not strict)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not strict:
            return data.decode("utf-8", errors="replace")
        raise DataError(f"{path}: byte {exc.start} is not valid UTF-8; convert the file to UTF-8") from None


def read_documents(files: Iterable[Path], strict: bool = True) -> Iterator[str]:
    for path in files:
        yield read_text(path, strict)


def files_signature(files: Iterable[Path]) -> str:
    """Hash of the file list with sizes and modification times: changes when the corpus does."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
