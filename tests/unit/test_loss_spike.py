"""The loss-spike detector (debugging/loss_spike.py): its window, z-score and decisions; the settings' checks and the
spike fault of drills."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from paratron.config import build_config
from paratron.config.faults import parse_faults
from paratron.config.validation import validate
from paratron.debugging.loss_spike import SpikeDetector
from paratron.distributed.topology import RankGroup
from paratron.errors import ConfigError
from paratron.training.faults import SPIKE_SCALE, AttemptFault, check_spike_fault


def test_nothing_is_judged_before_the_window_is_full():
    detector = SpikeDetector(zscore=3.0, window=4)
    assert [detector.judge(step, loss) for step, loss in enumerate([2.0, 2.1, 50.0, 1.9], start=1)] == [None] * 4
    assert len(detector.recent) == 4


def test_a_spike_is_measured_against_the_mean_and_deviation_of_the_last_calm_losses():
    detector = SpikeDetector(zscore=3.0, window=4)
    calm = [3.0, 3.2, 2.9, 3.1, 3.0]
    for step, loss in enumerate(calm, start=1):
        assert detector.judge(step, loss) is None
    window = calm[-4:]
    mean, std = statistics.fmean(window), statistics.pstdev(window)
    spike = detector.judge(6, 4.0)
    assert spike is not None and spike.step == 6 and spike.loss == 4.0
    assert spike.mean == pytest.approx(mean) and spike.std == pytest.approx(std)
    assert spike.zscore == pytest.approx((4.0 - mean) / std)
    assert "step 6: loss spike: loss 4.0000" in spike.describe() and f"z-score {spike.zscore:.1f}" in spike.describe()
    # the spike stays out of the window: a second one is judged against the same calm losses
    assert [loss for _, loss in detector.recent] == window
    assert detector.judge(7, 4.0) is not None
    just_below = mean + 2.9 * std
    assert detector.judge(8, just_below) is None and detector.recent[-1] == (8, just_below)


def test_a_drop_a_nonfinite_loss_and_a_flat_window_are_no_spikes():
    detector = SpikeDetector(zscore=2.0, window=3)
    for step in range(1, 4):
        detector.judge(step, 1.0)
    assert detector.judge(4, 0.1) is None  # (only a rise counts)
    assert detector.judge(5, math.nan) is None and detector.recent[-1] == (4, 0.1)  # (left to --on-nan)
    flat = SpikeDetector(zscore=2.0, window=2)
    flat.judge(1, 1.0), flat.judge(2, 1.0)
    assert flat.judge(3, 1.0) is None
    assert flat.judge(4, 1.0001).zscore == math.inf


def test_a_rollback_forgets_the_losses_of_the_steps_done_again():
    detector = SpikeDetector(zscore=3.0, window=5)
    for step in range(1, 8):
        detector.judge(step, float(step))
    detector.rewind(5)
    assert [step for step, _ in detector.recent] == [3, 4, 5]


def test_the_outcome_line_says_what_became_of_the_step():
    detector = SpikeDetector(zscore=1.0, window=2)
    detector.judge(1, 1.0), detector.judge(2, 1.2)
    spike = detector.judge(3, 9.0)
    assert spike.outcome("warn", 0) == "applied (--on-spike warn)"
    assert spike.outcome("skip", 2) == "step skipped (2 skipped so far, --on-spike skip)"
    assert spike.outcome("rollback", 1).startswith("no checkpoint in --save yet to roll back to, so step skipped")


def spike_settings(**overrides) -> dict:
    return dict(model_name="debug", mock_data=True, train_iters=4, loss_spike_zscore=4.0, **overrides)


def test_rollback_without_save_and_a_one_step_window_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^--on-spike rollback reloads the newest checkpoint of --save: give --save"):
        validate(build_config(spike_settings(on_spike="rollback")), 1)
    with pytest.raises(ConfigError, match=r"^--loss-spike-window 1: .* give --loss-spike-window 2 or more"):
        validate(build_config(spike_settings(loss_spike_window=1)), 1)
    validate(build_config(spike_settings(on_spike="rollback", save="/tmp/unused")), 1)
    validate(build_config(dict(model_name="debug", mock_data=True, on_spike="rollback", loss_spike_window=1)), 1)


def test_spike_is_a_fault_kind():
    assert parse_faults(["0:15:spike"])[0].kind == "spike"
    with pytest.raises(ConfigError, match="KIND one of crash, hang, nan, slow, spike"):
        parse_faults(["0:15:spikes"])


class Stage(torch.nn.Module):
    """A pipeline stage's model part: with the output layer (the last stage) or without."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)
        self.output = torch.nn.Linear(4, 8) if last else None


def test_a_spike_fault_must_name_a_rank_that_computes_logits():
    solo = RankGroup.solo()
    with pytest.raises(
        ConfigError, match=r"^--fault-inject 0:3:spike: rank 0 computes no logits .* last pipeline stage$"
    ):
        check_spike_fault(["0:3:spike"], 0, 0, Stage(last=False), solo)
    check_spike_fault(["0:3:spike"], 0, 0, Stage(last=True), solo)
    check_spike_fault(["1:3:spike"], 0, 0, Stage(last=False), solo)  # (another rank's: that one checks)
    check_spike_fault(["0:3:nan", "0:3:spike"], 0, 0, Stage(last=False), solo)  # (the second attempt's)
    with pytest.raises(ConfigError):
        check_spike_fault(["0:3:nan", "0:3:spike"], 1, 0, Stage(last=False), solo)


def test_a_spike_fault_scales_the_logits_of_its_step_only():
    stage = Stage(last=True)
    x = torch.randn(3, 4)
    plain = stage.output(stage.norm(x))
    fault = AttemptFault(["0:2:spike"], 0, 0)
    with fault.at(1, stage):
        assert torch.equal(stage.output(stage.norm(x)), plain)
    with fault.at(2, stage):
        assert torch.allclose(stage.output(stage.norm(x)), SPIKE_SCALE * plain)
    with fault.at(2, stage):  # (fired once: a rollback that passes the step again does not fire it again)
        assert torch.equal(stage.output(stage.norm(x)), plain)
