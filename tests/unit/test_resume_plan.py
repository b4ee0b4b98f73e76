"""How a run continues (training/resume.py), decided from the settings and what is on disk, and the
step window's clock that pauses for what is not training (training/step_log.py); in process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from paratron.checkpoint.verify import CheckpointInfo
from paratron.config.schema import CheckpointConfig, Config
from paratron.training.resume import ResumePlan, Start, TrainState, restarted_from, rollback_plan
from paratron.training.step_log import StepWindow


def _checkpoint(path: str = "/ckpt/iter_0000020", weights_only: bool = False) -> CheckpointInfo:
    return CheckpointInfo(Path(path), iteration=20, consumed_samples=320, config=Config(), weights_only=weights_only)


def test_no_checkpoint_starts_fresh():
    plan = ResumePlan.decide(CheckpointConfig(), None, None, restarted=False)
    assert plan.start is Start.FRESH and not plan.continuing
    assert plan.initial_state() == TrainState()


def test_a_paratron_checkpoint_resumes_at_its_step():
    c = CheckpointConfig(load="/ckpt")
    plan = ResumePlan.decide(c, _checkpoint(), Path("/ckpt"), restarted=False)
    assert plan.start is Start.RESUMED and plan.continuing
    state = plan.initial_state()
    assert (state.iteration, state.consumed_samples) == (20, 320)


@pytest.mark.parametrize("finetune, weights_only", [(True, False), (False, True)])
def test_weights_only_start_at_step_zero(finetune: bool, weights_only: bool):
    c = CheckpointConfig(load="/ckpt", finetune=finetune)
    plan = ResumePlan.decide(c, _checkpoint(weights_only=weights_only), Path("/cache/model"), restarted=False)
    assert plan.start is Start.WEIGHTS and not plan.continuing
    assert plan.initial_state() == TrainState()


def test_a_converted_megatron_checkpoint_continues_as_megatron():
    c = CheckpointConfig(load="/megatron")
    plan = ResumePlan.decide(c, _checkpoint("/cache/megatron/iter_0000020"), Path("/cache/megatron"), restarted=False)
    assert plan.start is Start.MEGATRON and plan.continuing
    assert plan.initial_state().iteration == 20


@pytest.mark.parametrize("finetune", [False, True])
def test_a_restart_continues_from_save_even_when_fine_tuning(finetune: bool):
    c = CheckpointConfig(load="/megatron", save="/save", finetune=finetune)
    plan = ResumePlan.decide(c, _checkpoint("/save/iter_0000020"), Path("/save"), restarted=True)
    assert plan.start is Start.RESTARTED and plan.continuing
    assert plan.initial_state().consumed_samples == 320


def test_restarted_from_needs_a_restart_and_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    c = CheckpointConfig(save=str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restarted_from(c) is None  # the first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restarted_from(c) is None  # died before its first save
    assert restarted_from(CheckpointConfig()) is None  # nothing saved anywhere


def test_rollback_without_a_checkpoint_has_none(tmp_path: Path):
    plan = rollback_plan(tmp_path)
    assert plan.start is Start.ROLLBACK and plan.checkpoint is None and not plan.continuing


def test_the_window_clock_stands_still_while_paused():
    window = StepWindow(torch.device("cpu"))
    window.restart(at=time.perf_counter() - 1.0)
    with window.paused():
        time.sleep(0.05)
    assert 1.0 <= window.seconds() < 1.5  # (the sleep is not counted; slack for a busy machine)


def test_the_window_clock_pauses_even_when_the_paused_work_fails():
    window = StepWindow(torch.device("cpu"))
    start = window.start
    with pytest.raises(RuntimeError), window.paused():
        time.sleep(0.02)
        raise RuntimeError("save failed")
    assert window.start >= start + 0.02


def test_restart_empties_the_window():
    window = StepWindow(torch.device("cpu"))
    window.loss += 3.0
    window.steps, window.samples = 2, 32
    window.restart()
    assert (float(window.loss), window.steps, window.samples, window.experts) == (0.0, 0, 0, None)
