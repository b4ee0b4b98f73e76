"""Leaving before --train-iters: signals, time budgets and intervals finish the step, save and exit
0; resuming from that checkpoint continues exactly; --keep-last prunes old checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from paratron.config import build_config
from paratron.training.exit import ExitConditions
from paratron.training.run import run_training

from tiny import tiny_config


def test_signal_is_caught_and_handlers_restored():
    config = build_config(dict(exit_signal_handler=True)).training
    before = signal.getsignal(signal.SIGTERM)
    with ExitConditions(config, torch.device("cpu")) as exits:
        assert exits.reason(1) is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits.reason(2) == "SIGTERM received (--exit-signal-handler)"
    assert signal.getsignal(signal.SIGTERM) is before


def test_duration_and_interval():
    config = build_config(dict(exit_duration_in_mins=1.0, exit_interval=5)).training
    exits = ExitConditions(config, torch.device("cpu"), started=time.monotonic())
    assert exits.reason(4) is None
    assert exits.reason(10) == "--exit-interval 5"
    exits.started -= 61
    assert exits.reason(4) == "--exit-duration-in-mins 1 reached"


def test_exit_interval_saves_and_the_resume_continues_exactly(tmp_path):
    common = dict(hidden_dropout=0.1, train_iters=10)
    straight = run_training(tiny_config(tmp_path / "straight", **common)).losses
    save = tmp_path / "ckpt"
    first = run_training(tiny_config(tmp_path / "run", exit_interval=4, save=str(save), **common)).losses
    assert len(first) == 4 and (save / "iter_0000004" / "meta.json").exists()
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    rest = run_training(tiny_config(tmp_path / "run", load=str(save), **common)).losses
    assert first + rest == straight


def test_keep_last_prunes_older_checkpoints(tmp_path):
    save = tmp_path / "ckpt"
    run_training(tiny_config(tmp_path / "run", train_iters=8, save=str(save), save_interval=2, keep_last=2))
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000006",
        "iter_0000008",
        "latest_checkpointed_iteration.txt",
    ]


def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path):
    save, run_dir = tmp_path / "ckpt", tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "paratron",
        "train",
        "--config",
        "debug",
        "--mock-data",
        "--train-iters",
        "100000",
        "--exit-signal-handler",
        "--save",
        str(save),
        "--run-dir",
        str(run_dir),
        "--log-interval",
        "1",
        "--no-progress-bar",
        "--no-tensorboard",
        "--eval-iters",
        "0",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "SIGTERM received (--exit-signal-handler)" in output
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    assert (save / f"iter_{last:07d}" / "meta.json").exists() and 2 <= last < 100000


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_newest_good_one(tmp_path, capsys):
    import pytest

    from paratron.checkpoint import read_checkpoint
    from paratron.errors import CheckpointError

    save = tmp_path / "ckpt"
    run_training(tiny_config(tmp_path / "run", train_iters=6, save=str(save), save_interval=2))
    weights = save / "iter_0000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    info = read_checkpoint(save)
    assert info.iteration == 4 and "iter_0000006/model.safetensors: checksum mismatch" in info.passed_over[0]
    with pytest.raises(CheckpointError, match="checksum mismatch; the file is corrupted"):
        read_checkpoint(save / "iter_0000006")  # named explicitly: an error, not a fallback
    (save / "iter_0000004" / "meta.json").unlink()  # half-written
    state = run_training(tiny_config(tmp_path / "run2", train_iters=4, load=str(save)))
    assert len(state.losses) == 2  # resumed from step 2
    assert "passed over a damaged checkpoint" in capsys.readouterr().out


def test_async_save_gives_the_same_checkpoints_and_resume(tmp_path):
    """Written in the background while training goes on: the same files, published in order, and
    the resume as exact as from a synchronous save."""
    common = dict(hidden_dropout=0.1, train_iters=8, save_interval=4)
    sync = run_training(tiny_config(tmp_path / "sync", save=str(tmp_path / "s"), **common)).losses
    background = run_training(
        tiny_config(tmp_path / "async", save=str(tmp_path / "a"), async_save=True, **common)
    ).losses
    assert background == sync
    from safetensors import safe_open

    for name in ("iter_0000004", "iter_0000008"):
        files = json.loads((tmp_path / "s" / name / "meta.json").read_text())["files"]
        assert sorted(json.loads((tmp_path / "a" / name / "meta.json").read_text())["files"]) == sorted(files)
        for file in (f for f in files if f.endswith(".safetensors")):  # the snapshot precedes later steps
            with (
                safe_open(str(tmp_path / "a" / name / file), "pt") as a,
                safe_open(str(tmp_path / "s" / name / file), "pt") as s,
            ):
                assert a.metadata() == s.metadata() and sorted(a.keys()) == sorted(s.keys())
                assert all(torch.equal(a.get_tensor(k), s.get_tensor(k)) for k in a.keys()), (name, file)
    resumed = run_training(tiny_config(tmp_path / "r", load=str(tmp_path / "a" / "iter_0000004"), **common)).losses
    assert resumed == sync[4:]
