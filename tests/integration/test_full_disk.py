"""A full disk is one line (exit 2) and leaves nothing half-written: checkpoints (in the
background too, and with two ranks), conversions, preprocessed data, plans. The disks are small
tmpfs mounts; where mounting is not permitted, a folder that acts as one (`FakeDisk`) runs the
same assertions."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch

from paratron.checkpoint.formats import paratron_to_hf
from paratron.checkpoint.lock import LOCK_NAME
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.cli import main
from paratron.data.preprocess import save_trained_tokenizer
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.distributed.local_ranks import run_ranks
from paratron.errors import UserError
from paratron.model.gpt import build_model
from paratron.storage import is_disk_full, save_object, save_tensors, space_at, write_text_atomic, writing

from tiny import WORDS, tiny_config

TRAIN = [
    "train",
    *("--config", "debug", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--vocab-size", "128", "--max-position-embeddings", "16", "--seq-length", "16", "--micro-batch-size", "2"),
    *("--train-iters", "2", "--lr-warmup-iters", "1", "--eval-iters", "0", "--no-progress-bar", "--no-tensorboard"),
]
"""Two steps of a tiny model whose checkpoint takes about 600 kB."""
ROOM_FOR_ONE = 900 * 1024
"""A disk that holds one checkpoint of `TRAIN`'s model, not two."""
SIZE = r"\d+(?:\.\d)? (?:B|kB|MB|GB|TB)"


# ---------------------------------------------------------------- small disks


def _mount(folder: Path, size: int) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return done.returncode == 0


class FakeDisk:
    """A folder that acts as a filesystem of `size` bytes where tmpfs cannot be mounted: the free
    space reported for it shrinks as files are written there, and a write that would pass `size`
    fails with ENOSPC, through Python's files and safetensors alike."""

    def __init__(self, folder: Path, size: int) -> None:
        self.folder, self.size = folder.resolve(), size

    def holds(self, path: object) -> bool:
        return isinstance(path, (str, os.PathLike)) and Path(os.path.abspath(path)).is_relative_to(self.folder)

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.folder.rglob("*") if p.is_file() and not p.is_symlink())

    def refuse(self, nbytes: int, path: object) -> None:
        if self.used() + nbytes > self.size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        real_usage, real_open, real_save = shutil.disk_usage, io.open, safetensors.torch.save_file
        disk = self

        def usage(path):
            if not disk.holds(path):
                return real_usage(path)
            used = disk.used()
            return real_usage(path)._replace(total=disk.size, used=used, free=max(disk.size - used, 0))

        class Limited:
            def __init__(self, file, path):
                self.file, self.path = file, path

            def write(self, data):
                disk.refuse(len(data), self.path)
                written = self.file.write(data)
                self.file.flush()
                return written

            def __getattr__(self, name):
                return getattr(self.file, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.file.close()

        def limited_open(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            return Limited(handle, file) if disk.holds(file) and set(mode) & set("wax+") else handle

        def limited_save(tensors, filename, metadata=None):
            if disk.holds(filename):
                disk.refuse(len(safetensors.torch.save(tensors, metadata)), filename)
            real_save(tensors, filename, metadata=metadata)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(shutil, "disk_usage", usage)
            patch.setattr(shutil, "_USE_CP_SENDFILE", False)  # (copies go through `write` too)
            patch.setattr(io, "open", limited_open)
            patch.setattr("builtins.open", limited_open)
            patch.setattr(safetensors.torch, "save_file", limited_save)
            yield


@contextlib.contextmanager
def small_disk(folder: Path, size: int) -> Iterator[tuple[Path, bool]]:
    """A filesystem of `size` bytes at `folder`, and whether it is a real (tmpfs) one."""
    folder.mkdir(parents=True)
    if _mount(folder, size):
        try:
            yield folder, True
        finally:
            subprocess.run(["umount", str(folder)], check=True)
        return
    with FakeDisk(folder, size).active():
        yield folder, False


@contextlib.contextmanager
def free_space_overstated(free: int | None = None) -> Iterator[None]:
    """Every filesystem reported as empty (or with `free` bytes): a check before writing passes,
    and the write itself meets the full disk."""
    real = shutil.disk_usage
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free or real(path).total))
        yield


def one_error_line(err: str) -> str:
    """The single line a failed command printed (no traceback, nothing else)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def sizes(line: str) -> list[float]:
    """The byte counts a line gives, in bytes."""
    scale = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    return [float(n) * scale[u] for n, u in re.findall(r"(\d+(?:\.\d)?) (B|kB|MB|GB|TB)", line)]


def assert_only_the_first_checkpoint(save: Path) -> None:
    assert sorted(p.name for p in save.iterdir() if p.name != LOCK_NAME) == [
        "iter_0000001",
        "latest_checkpointed_iteration.txt",
    ]
    assert read_checkpoint(save).iteration == 1  # (every checksum verified)


# ---------------------------------------------------------------- checkpoints


def test_a_background_save_that_fills_the_disk_is_one_line_and_the_run_resumes(tmp_path, capsys):
    with small_disk(tmp_path / "disk", ROOM_FOR_ONE) as (disk, _), free_space_overstated():
        save = disk / "ck"
        code = main(
            [*TRAIN, "--save-interval", "1", "--async-save", "--run-dir", str(tmp_path / "a"), "--save", str(save)]
        )
        line = one_error_line(capsys.readouterr().err)
        assert code == 2
        assert re.fullmatch(
            rf"error: no space left on {re.escape(str(space_at(disk).mount))} while writing checkpoint iteration 2 "
            rf"\({re.escape(str(save))}/\.tmp-iter_0000002\): it needs {SIZE}, {SIZE} were free; "
            r"free space or choose another --save",
            line,
        ), line
        assert_only_the_first_checkpoint(save)  # the partial folder is gone
        assert main([*TRAIN, "--run-dir", str(tmp_path / "b"), "--load", str(save)]) == 0
    steps = [json.loads(r)["step"] for r in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2]  # resumed after iteration 1


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, capsys):
    with small_disk(tmp_path / "disk", ROOM_FOR_ONE) as (disk, _):
        save = disk / "ck"
        code = main([*TRAIN, "--save-interval", "1", "--run-dir", str(tmp_path / "a"), "--save", str(save)])
        line = one_error_line(capsys.readouterr().err)
        assert code == 2
        assert re.fullmatch(
            rf"error: not enough space on {re.escape(str(space_at(disk).mount))} for checkpoint iteration 2 "
            rf"\({re.escape(str(save))}/iter_0000002\): it needs {SIZE}, {SIZE} are free; "
            r"free space or choose another --save",
            line,
        ), line
        needed, free = sizes(line)
        assert needed > free > 0
        assert_only_the_first_checkpoint(save)


def _save_twice_on_two_ranks(run_dir: str, refusing: str, failing: str, real_disks: bool, size: int) -> list:
    """On each rank: a run whose second save is refused before writing, then one whose second
    save fails while writing; each rank's exit code, printed line and reported line."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = []
    with contextlib.ExitStack() as stack:
        if not real_disks:
            stack.enter_context(FakeDisk(Path(refusing), size).active())
            stack.enter_context(FakeDisk(Path(failing), size).active())
        for save, overstated in ((refusing, False), (failing, True)):
            reports = Path(run_dir) / f"reports-{Path(save).name}"
            reports.mkdir(parents=True, exist_ok=True)
            os.environ["PARATRON_ERROR_DIR"] = str(reports)  # (as under the launcher: rank 1's line goes there)
            err = io.StringIO()
            with contextlib.redirect_stderr(err), free_space_overstated() if overstated else contextlib.nullcontext():
                flags = [*TRAIN, "--tensor-model-parallel-size", "2", "--save-interval", "1"]
                code = main([*flags, "--run-dir", f"{run_dir}/{Path(save).name}", "--save", f"{save}/ck"])
            reported = sorted(reports.glob("rank*.txt"))
            out.append((code, err.getvalue(), [p.read_text() for p in reported]))
    dist.destroy_process_group()
    return out


def test_two_ranks_end_with_the_same_line(tmp_path):
    with (
        small_disk(tmp_path / "refusing", ROOM_FOR_ONE) as (refusing, real),
        small_disk(tmp_path / "failing", ROOM_FOR_ONE) as (failing, _),
    ):
        ranks = run_ranks(
            _save_twice_on_two_ranks, 2, str(tmp_path / "runs"), str(refusing), str(failing), real, ROOM_FOR_ONE
        )
        for disk, (first, second), kind in zip((refusing, failing), zip(*ranks), ("not enough", "no space")):
            assert first[0] == second[0] == 2
            line = one_error_line(first[1])
            assert line.startswith(f"error: {kind}") and "checkpoint iteration 2" in line, line
            assert second[1] == "" and second[2] == [line.removeprefix("error: ")]  # rank 1's line, for the launcher
            assert_only_the_first_checkpoint(disk / "ck")
            first_checkpoint = sum(p.stat().st_size for p in (disk / "ck" / "iter_0000001").iterdir())
            assert sizes(line)[0] >= first_checkpoint  # both ranks' halves of it, summed


# ---------------------------------------------------------------- conversions, data, plans


@pytest.mark.parametrize("free_space", ["reported", "overstated"])
def test_conversions_on_a_full_disk(tmp_path, capsys, free_space):
    """Refused before writing where the free space is told, met while writing where it is overstated."""
    config = tiny_config(tmp_path, num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97)
    save_checkpoint(tmp_path / "paratron", CheckpointContent(0, 0, config, build_model(config.model)))
    paratron_to_hf(tmp_path / "paratron", tmp_path / "hf")
    overstated = free_space_overstated(10**7) if free_space == "overstated" else contextlib.nullcontext()
    start = "not enough space on {} for" if free_space == "reported" else "no space left on {} while writing"
    with small_disk(tmp_path / "disk", 32 * 1024) as (disk, _), overstated:
        mount = re.escape(str(space_at(disk).mount))
        for source, target, what in (
            ("hf", "paratron", "the converted checkpoint"),
            ("paratron", "hf", "the Hugging Face model"),
        ):
            code = main(["convert", "--from", source, str(tmp_path / source), "--to", target, str(disk / "out")])
            line = one_error_line(capsys.readouterr().err)
            assert code == 2
            assert re.fullmatch(
                rf"error: {start.format(mount)} {what} \({re.escape(str(disk))}/\S+\): it needs {SIZE}, {SIZE} "
                r"(are|were) free; free space or choose another destination \(convert --to FORMAT DIR\)",
                line,
            ), line
            assert list(disk.iterdir()) == []  # nothing half-written left


def test_preprocess_and_its_tokenizer_on_a_full_disk(tmp_path, capsys):
    rows = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(300)) for i in range(100)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    tokenizer = train_byte_level_bpe(iter(rows), 300)
    tokenizer.save(tmp_path / "tokenizer.json")
    with small_disk(tmp_path / "disk", 16 * 1024) as (disk, _):
        mount = re.escape(str(space_at(disk).mount))
        code = main(
            [
                *("preprocess", "--input", str(tmp_path / "corpus.jsonl"), "--output-prefix", str(disk / "corpus")),
                *("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tokenizer.json")),
                "--no-progress-bar",
            ]
        )
        line = one_error_line(capsys.readouterr().err)
        assert code == 2
        assert re.fullmatch(
            rf"error: no space left on {mount} while writing the indexed dataset "
            rf"\({re.escape(str(disk))}/corpus_text_document\.bin\): it needs {SIZE}, {SIZE} were free; "
            r"free space or choose another --output-prefix",
            line,
        ), line
        needed, free = sizes(line)
        assert needed > free  # (the whole output, projected from what was written)
        assert list(disk.iterdir()) == []
        (disk / "filler").write_bytes(b"x" * 14 * 1024)
        with pytest.raises(UserError) as caught:
            save_trained_tokenizer(tokenizer, str(disk / "bpe"))
        assert re.fullmatch(
            rf"no space left on {mount} while writing the trained tokenizer \({re.escape(str(disk))}/bpe_tokenizer"
            rf"\.json\): it needs {SIZE}, {SIZE} were free; free space or choose another --output-prefix",
            str(caught.value),
        ), caught.value
        with pytest.raises(UserError, match=rf"^no space left on {mount} while writing a file \(.*results\.json\)"):
            write_text_atomic(disk / "results.json", "x" * 100_000)  # (evaluation results go this way)
        assert [p.name for p in disk.iterdir()] == ["filler"]


def test_full_disk_errors_of_every_writer_are_recognised(tmp_path):
    """torch's writer reports only a position mismatch, wrapping the OSError; safetensors' Rust
    error names it in text: each becomes the one line, and the partial file is removed."""
    with small_disk(tmp_path / "disk", 16 * 1024) as (disk, _):
        mount = re.escape(str(space_at(disk).mount))
        for name, write in (
            ("state.pt", lambda path: save_object({"t": torch.zeros(100_000)}, path)),
            ("weights.safetensors", lambda path: save_tensors({"t": torch.zeros(100_000)}, path)),
        ):
            with pytest.raises(UserError) as caught, writing(name, disk / name, 400_000, "fix it", partial=disk / name):
                write(disk / name)
            assert re.fullmatch(
                rf"no space left on {mount} while writing {re.escape(name)} \({re.escape(str(disk / name))}\): "
                rf"it needs 400\.0 kB, {SIZE} were free; fix it",
                str(caught.value),
            ), caught.value
            assert list(disk.iterdir()) == []
    quota, wrapped = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "x"), RuntimeError("unexpected pos 704 vs 598")
    wrapped.__context__ = quota
    assert is_disk_full(quota) and is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(UserError("x: No space left on device"))  # (reported already)


def test_plans_on_a_full_disk(tmp_path, capsys):
    plan = ["plan", "--config", "debug", "--global-batch-size", "8", "--hardware", "h100-80g", "--gpus-per-node", "2"]
    with small_disk(tmp_path / "disk", 8 * 1024) as (disk, _):
        mount = re.escape(str(space_at(disk).mount))
        assert main([*plan, "--output", str(disk / "plans.json")]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert re.fullmatch(
            rf"error: no space left on {mount} while writing the plans \({re.escape(str(disk))}/plans\.json\): "
            rf"it needs {SIZE}, {SIZE} were free; free space or choose another --output",
            line,
        ), line
        assert main([*plan, "--output", str(tmp_path / "plans.json"), "--plot", str(disk / "plans.png")]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert re.fullmatch(
            rf"error: no space left on {mount} while writing the plans' plot \({re.escape(str(disk))}/plans\.png\): "
            rf"it needs {SIZE}, {SIZE} were free; free space or choose another --plot",
            line,
        ), line
        assert list(disk.iterdir()) == []
    assert json.loads((tmp_path / "plans.json").read_text())["plans"]  # (written whole before the plot failed)
