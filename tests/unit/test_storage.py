"""A file is written whole or not at all: through a temporary file beside it, renamed into place,
removed when the writer fails, with the mode the umask gives."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from paratron.storage import replacing, temporary_beside, write_bytes_atomic, write_text_atomic


def test_written_whole_with_nothing_left_beside(tmp_path: Path) -> None:
    target = tmp_path / "deeper" / "plans.json"
    write_text_atomic(target, "first\n")
    write_text_atomic(target, "second\n")
    write_bytes_atomic(tmp_path / "raw.bin", b"\x00\x01")
    assert target.read_text(encoding="utf-8") == "second\n"
    assert (tmp_path / "raw.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in target.parent.iterdir()) == ["plans.json"]


def test_a_failed_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "trace.json"
    target.write_text("old", encoding="utf-8")
    with pytest.raises(RuntimeError, match="stopped"):
        with replacing(target) as tmp:
            tmp.write_text("half", encoding="utf-8")
            raise RuntimeError("stopped")
    assert target.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_temporary_names_are_hidden_beside_and_never_shared(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    names = {temporary_beside(target) for _ in range(50)}
    assert len(names) == 50
    assert all(name.parent == tmp_path and name.name.startswith(".model.safetensors.tmp-") for name in names)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_mode_follows_the_umask(tmp_path: Path, mask: int) -> None:
    previous = os.umask(mask)
    try:
        write_text_atomic(tmp_path / "result.json", "{}")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "result.json").stat().st_mode) == 0o666 & ~mask
