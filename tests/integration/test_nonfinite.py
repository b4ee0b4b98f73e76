"""--on-nan: a step whose gradients are not finite is not applied, the first module whose output
or gradient went non-finite is named, and the run stops, skips the batch or rolls back to the
newest checkpoint without it. NaNs are injected with --fault-inject RANK:STEP:nan (the forward
output of the rank's first layer with weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from paratron.checkpoint.verify import read_checkpoint
from paratron.distributed.local_ranks import run_ranks
from paratron.errors import NonFiniteStop
from paratron.training.run import run_training

from tiny import tiny_config

RUN = dict(train_iters=6, lr_warmup_iters=1, save_interval=2)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_skip_names_the_module_and_goes_on(tmp_path, capsys):
    state = run_training(tiny_config(tmp_path, **RUN, fault_inject=["0:3:nan"], on_nan="skip"))
    out = capsys.readouterr().out
    assert (
        "step 3: the gradients are not finite; first non-finite: the forward output of embedding on rank 0 "
        "(pipeline stage 0); step skipped (--on-nan skip)" in out
    )
    assert state.skipped_iterations == 1 and state.iteration == 6
    logged = records(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 4, 5, 6] and all(math.isfinite(r["loss"]) for r in logged)


def test_rollback_reloads_the_checkpoint_and_leaves_the_batch_out(tmp_path, capsys):
    calm = run_training(tiny_config(tmp_path / "calm", **RUN))
    state = run_training(
        tiny_config(tmp_path / "run", **RUN, fault_inject=["0:3:nan"], on_nan="rollback", save=str(tmp_path / "ck"))
    )
    out = capsys.readouterr().out
    assert f"back to {tmp_path / 'ck' / 'iter_0000002'}, without this step's batch (--on-nan rollback)" in out
    assert state.iteration == 6 and state.consumed_samples == calm.consumed_samples + 8  # one batch of 8 left out
    steps = [r["step"] for r in records(tmp_path / "run")]
    assert steps == [1, 2, 3, 4, 5, 6]  # the records after the checkpoint were rewritten, not doubled
    assert [r["loss"] for r in records(tmp_path / "run")][:2] == [r["loss"] for r in records(tmp_path / "calm")][:2]


def test_stop_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    with pytest.raises(NonFiniteStop) as stop:
        run_training(tiny_config(tmp_path, **RUN, fault_inject=["0:5:nan"], save=str(tmp_path / "ck")))  # the default
    assert str(stop.value) == (
        "step 5: the gradients are not finite; first non-finite: the forward output of embedding on rank 0 "
        "(pipeline stage 0); stopped (--on-nan stop)"
    )
    assert read_checkpoint(tmp_path / "ck").iteration == 4


def _pipeline_skip(run_dir: str) -> str:
    run_training(
        tiny_config(Path(run_dir), **RUN, pipeline_model_parallel_size=2, fault_inject=["1:2:nan"], on_nan="skip")
    )
    return (Path(run_dir) / "metrics.jsonl").read_text() if Path(run_dir, "metrics.jsonl").exists() else ""


def test_the_earliest_stage_that_went_non_finite_is_named_across_ranks(tmp_path, capfd):
    """The NaN starts on the second pipeline stage (rank 1): rank 0 saw only gradients of it, so
    the report is rank 1's first layer."""
    logged = run_ranks(_pipeline_skip, 2, str(tmp_path))[0]
    assert [json.loads(line)["step"] for line in logged.splitlines()] == [1, 3, 4, 5, 6]
    out = capfd.readouterr().out
    assert "step 2: the gradients are not finite; first non-finite: the forward output of " in out
    assert "on rank 1 (pipeline stage 1); step skipped (--on-nan skip)" in out
