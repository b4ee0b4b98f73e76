"""--step-batch-size-schedule against Megatron-LM main's StepBatchsizeNumMicroBatchesCalculator, the
ramp as the same BatchSchedule against megatron-core's calculator, the refusals, and a tiny run whose
batches change at the thresholds."""

from __future__ import annotations

import json
import warnings

import pytest

from paratron.cli import main
from paratron.commands.train import train_config
from paratron.config import validate
from paratron.config.samples import BatchRamp, step_schedule
from paratron.errors import ConfigError
from paratron.training.run import run_training

from tiny import tiny_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

MAIN_CALCULATOR = {
    # (schedule, seq_length): [(consumed samples, global batch)], and {train_samples: train_iters}.
    # Computed once by Megatron-LM main's megatron/core/num_microbatches_calculator.py (commit d98e8a64dd):
    # StepBatchsizeNumMicroBatchesCalculator(mbs, dp, False, 0, schedule, seq_length).update(consumed) and
    # training.update_train_iters' loop. megatron-core 0.16.1 has no step schedule to run here.
    ("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048): (
        [(0, 16), (1, 16), (1171874, 16), (1171875, 320), (1171876, 320), (2343749, 320), (2343750, 624),
         (2343751, 624), (3515624, 624), (3515625, 928), (3515626, 928), (4687499, 928), (4687500, 1232),
         (4687501, 1232), (5859374, 1232), (5859375, 1536), (5859376, 1536), (11718750, 1536)],
        {1: 1, 50: 4, 100: 7, 137: 9},
    ),
    ("0:8 1K:16 2.5K:32", 32): (
        [(0, 8), (1, 8), (30, 8), (31, 16), (32, 16), (77, 16), (78, 32), (79, 32), (156, 32)],
        {1: 1, 50: 6, 100: 8, 137: 9},
    ),
    ("0:4 640:8 1280:12", 64): (
        [(0, 4), (1, 4), (9, 4), (10, 8), (11, 8), (19, 8), (20, 12), (21, 12), (40, 12)],
        {1: 1, 50: 7, 100: 11, 137: 14},
    ),
}  # fmt: skip


@pytest.mark.parametrize("key", MAIN_CALCULATOR)
def test_step_schedule_matches_megatron_main(key):
    text, seq_length = key
    batches, iters = MAIN_CALCULATOR[key]
    schedule = step_schedule(text, seq_length)
    assert [(consumed, schedule.batch_at(consumed)) for consumed, _ in batches] == batches
    assert {samples: schedule.train_iters(samples) for samples in iters} == iters


@pytest.mark.parametrize("ramp", [(4, 4, 100, 16), (8, 8, 1000, 32), (2, 6, 7, 20), (3, 1, 1, 5), (16, 16, 3000, 256)])
def test_the_ramp_as_a_schedule_matches_megatron_core(ramp):
    start, increment, samples, gbs = ramp
    schedule = BatchRamp(*ramp).schedule()
    theirs = RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, 1, start, increment, samples)
    for consumed in range(0, samples + 3 * gbs):
        theirs.update(consumed, False)
        assert schedule.batch_at(consumed) == theirs.get_current_global_batch_size(), consumed
    for train_samples in (1, samples // 2, samples, samples + 5, samples + 3 * gbs + 1):
        iters, consumed = 0, 0  # core 0.16.1's update_train_iters
        while consumed <= samples and consumed <= train_samples:
            theirs.update(consumed, False)
            consumed += theirs.get_current_global_batch_size()
            iters += 1
        iters += max(train_samples - consumed, 0) // gbs
        assert schedule.train_iters(train_samples) == iters, train_samples


def test_the_schedule_sets_the_global_batch_and_the_steps_of_samples():
    config = train_config(["--step-batch-size-schedule", "0:8 1K:16 2.5K:32", "--seq-length", "32", "--mock-data"])
    assert config.training.global_batch_size == 32
    sampled = ["--train-samples", "137", "--micro-batch-size", "8", "--mock-data"]
    config = train_config([*sampled, "--step-batch-size-schedule", "0:8 1K:16 2.5K:32", "--seq-length", "32"])
    assert config.training.train_iters == 9  # Megatron-LM main's update_train_iters (above)
    validate(config, 1)


@pytest.mark.parametrize(
    "schedule, extra, message",
    [
        ("0:8 64:16 32:32", [], "thresholds must rise"),
        ("64:8 128:16", [], "the first threshold must be 0"),
        ("0:8 64:12", [], "the batch of 12 is not a multiple of --micro-batch-size x data-parallel size (8)"),
        ("0:8 1X:16", [], "'1X' is not a count"),
        ("0:8 64-16", [], "entry '64-16' is not THRESHOLD:BATCH"),
        ("0:8 64:16", ["--global-batch-size", "32"], "ends at a batch of 16 but --global-batch-size is 32"),
        ("0:8 64:16", ["--rampup-batch-size", "8", "8", "64"], "both change the batch size"),
    ],
)
def test_bad_schedules_are_refused_naming_the_flag(schedule, extra, message):
    argv = ["--step-batch-size-schedule", schedule, "--micro-batch-size", "8", "--seq-length", "32", "--mock-data"]
    with pytest.raises(ConfigError) as error:
        validate(train_config([*argv, *extra]), 1)
    assert str(error.value).startswith(f"--step-batch-size-schedule {schedule!r}")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_bad_schedule_exits_2_in_one_line(capsys):
    assert main(["train", "--step-batch-size-schedule", "640:8", "--mock-data", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--step-batch-size-schedule '640:8': the first threshold must be 0" in err


def test_a_run_trains_the_scheduled_batches(tmp_path):
    """Thresholds of 96 and 256 tokens (3 and 8 samples of 32 tokens): batches of 2, then 4, then 8."""
    config = tiny_config(
        tmp_path, micro_batch_size=2, train_iters=5, step_batch_size_schedule=["0:2 96:4 256:8"], lr_warmup_iters=0
    )
    validate(config, 1)
    run_training(config)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["consumed_samples"] for r in records] == [2, 4, 8, 16, 24]  # batches 2, 2, 4, 8, 8


def test_a_resumed_run_goes_on_with_the_schedules_batches(tmp_path):
    """Resumed at step 2 (4 samples consumed), the run trains the batches the whole run trained."""
    settings = dict(micro_batch_size=2, train_iters=5, step_batch_size_schedule=["0:2 96:4 256:8"], lr_warmup_iters=0)
    run_training(tiny_config(tmp_path / "whole", **settings))
    run_training(tiny_config(tmp_path / "first", **settings, save=str(tmp_path / "ckpt"), save_interval=2))
    run_training(tiny_config(tmp_path / "resumed", **settings, load=str(tmp_path / "ckpt" / "iter_0000002")))

    def records(name: str) -> list[tuple[int, float]]:
        return [(r["consumed_samples"], r["lr"]) for r in map(json.loads, open(tmp_path / name / "metrics.jsonl"))]

    assert [c for c, _ in records("whole")] == [2, 4, 8, 16, 24]
    assert records("resumed") == records("whole")[2:]
