"""Checkpoints and converted folders are written with the modes the umask gives, as `torch.save`
and `open` do (safetensors alone would make every weights file 0600): teammates on a shared
filesystem can read them under umask 022, nobody else can under 077."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from paratron.checkpoint.formats import hf_to_paratron, paratron_to_hf, paratron_to_megatron
from paratron.cli import main
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.storage import current_umask, honour_umask, save_tensors

from tiny import WORDS

TRAIN = [
    *("train", "--config", "debug", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--vocab-size", "128", "--max-position-embeddings", "16", "--seq-length", "16", "--micro-batch-size", "2"),
    *("--train-iters", "2", "--lr-warmup-iters", "1", "--eval-iters", "0", "--no-progress-bar", "--no-tensorboard"),
]


@pytest.fixture(params=[0o022, 0o077], ids=["umask-022", "umask-077"])
def umask(request) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def modes(folder: Path) -> dict[str, int]:
    """Every entry's permission bits, the folder's own under '.'."""
    entries = [folder, *folder.rglob("*")]
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in entries}


def test_current_umask_is_read_without_changing_it(umask):
    assert current_umask() == umask
    assert current_umask() == umask


def test_safetensors_files_follow_the_umask(tmp_path, umask):
    save_tensors({"w": torch.zeros(2)}, tmp_path / "w.safetensors")
    assert stat.S_IMODE((tmp_path / "w.safetensors").stat().st_mode) == 0o666 & ~umask


def test_checkpoints_and_conversions_follow_the_umask(tmp_path, umask):
    save = tmp_path / "ck"
    assert main([*TRAIN, "--run-dir", str(tmp_path / "run"), "--save", str(save)]) == 0
    paratron_to_hf(save, tmp_path / "hf")
    tokenizer = train_byte_level_bpe(iter([" ".join(WORDS)] * 20), 300)
    tokenizer.save(tmp_path / "hf" / "tokenizer.json")
    os.chmod(tmp_path / "hf" / "tokenizer.json", 0o600)  # a copied file would keep this mode
    hf_to_paratron(tmp_path / "hf", tmp_path / "converted")
    shutil.rmtree(tmp_path / "hf")
    paratron_to_hf(tmp_path / "converted", tmp_path / "hf")
    paratron_to_megatron(save, tmp_path / "megatron", tp=2)
    files, folders = 0o666 & ~umask, 0o777 & ~umask
    written = {name: modes(tmp_path / name) for name in ("ck", "converted", "hf", "megatron")}
    assert "iter_0000002/model.safetensors" in written["ck"] and "iter_0000002/optimizer.index.json" in written["ck"]
    assert "iter_0000000/tokenizer.json" in written["converted"] and "model.yaml" in written["converted"]
    assert "tokenizer.json" in written["hf"] and "model.safetensors" in written["hf"]
    assert "iter_0000002/mp_rank_01/model_optim_rng.pt" in written["megatron"]
    for name, found in written.items():
        for entry, mode in found.items():
            expected = folders if (tmp_path / name / entry).is_dir() else files
            assert mode == expected, f"{name}/{entry}: {oct(mode)}, not {oct(expected)}"


def test_honour_umask_covers_a_folder_and_its_contents(tmp_path, umask):
    (tmp_path / "out" / "sub").mkdir(parents=True)
    (tmp_path / "out" / "sub" / "file").write_text("x")
    os.chmod(tmp_path / "out" / "sub" / "file", 0o600)
    os.chmod(tmp_path / "out" / "sub", 0o700)
    honour_umask(tmp_path / "out")
    assert modes(tmp_path / "out") == {".": 0o777 & ~umask, "sub": 0o777 & ~umask, "sub/file": 0o666 & ~umask}
