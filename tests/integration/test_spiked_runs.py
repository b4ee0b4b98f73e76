"""Loss spikes in a real run: `--fault-inject 0:7:spike` makes step 7's loss jump (its logits scaled), and
`--on-spike` warns (the step is applied), skips it (the weights stay as they were: every layer's update ratio is 0)
or rolls back to the newest checkpoint and goes on without its batch, which then trains exactly as the skipped run
does one step later."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratron.training.run import run_training

from tiny import tiny_config

SPIKE_STEP = 7


def spiked_run(run_dir: Path, on_spike: str, **overrides) -> list[dict]:
    config = tiny_config(
        run_dir,
        train_iters=10,
        seq_length=16,
        micro_batch_size=2,
        global_batch_size=4,
        loss_spike_zscore=6.0,
        loss_spike_window=4,
        on_spike=on_spike,
        fault_inject=[f"0:{SPIKE_STEP}:spike"],
        log_layer_stats=SPIKE_STEP,
        **overrides,
    )
    run_training(config)
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def skipped(tmp_path_factory) -> list[dict]:
    return spiked_run(tmp_path_factory.mktemp("skip"), "skip")


def test_a_skipped_spike_is_said_counted_and_leaves_the_weights_as_they_were(skipped):
    spike = skipped[SPIKE_STEP - 1]
    assert spike["step"] == SPIKE_STEP and spike["loss_spike"] > 50 and spike["loss"] > 2 * skipped[0]["loss"]
    assert [r.get("loss_spike") for r in skipped].count(None) == len(skipped) - 1
    assert [r["skipped_iterations"] for r in skipped] == [0] * (SPIKE_STEP - 1) + [1] * (11 - SPIKE_STEP)
    ratios = {key: value for key, value in spike.items() if key.endswith("/update_ratio")}
    assert len(ratios) == 4 and set(ratios.values()) == {0.0}  # (embedding, 2 layers, final norm; tied output)
    assert all(0.5 < r["loss"] / skipped[0]["loss"] < 1.5 for r in skipped[SPIKE_STEP:])  # training goes on calmly


def test_a_warned_spike_is_applied(tmp_path, skipped, capsys):
    warned = spiked_run(tmp_path, "warn")
    out = capsys.readouterr().out
    assert f"step {SPIKE_STEP}: loss spike: loss " in out and "; applied (--on-spike warn)" in out
    assert warned[SPIKE_STEP - 1]["loss_spike"] == skipped[SPIKE_STEP - 1]["loss_spike"]
    assert [r["loss"] for r in warned[:SPIKE_STEP]] == [r["loss"] for r in skipped[:SPIKE_STEP]]
    assert warned[SPIKE_STEP - 1]["layers/layers.0/update_ratio"] > 0 and warned[-1]["skipped_iterations"] == 0
    assert warned[SPIKE_STEP]["loss"] != skipped[SPIKE_STEP]["loss"]  # (the spike's update was applied)


def test_a_rolled_back_spike_goes_back_to_the_checkpoint_and_leaves_its_batch_out(tmp_path, skipped, capsys):
    rolled = spiked_run(tmp_path / "run", "rollback", save=str(tmp_path / "ckpt"), save_interval=5)
    out = capsys.readouterr().out
    assert f"back to {tmp_path / 'ckpt' / 'iter_0000005'}, without this step's batch (--on-spike rollback)" in out
    assert [r["step"] for r in rolled] == list(range(1, 11)) and "loss_spike" not in json.dumps(rolled)
    batch = 4
    assert [r["consumed_samples"] for r in rolled[SPIKE_STEP - 1 :]] == [
        (step + 1) * batch for step in range(SPIKE_STEP, 11)
    ]  # (the spike's batch is left out: one more batch consumed from then on)
    # after the spike both runs hold the same weights, the same optimizer state and learning rate: the rolled-back run
    # trains on batch k + 1 at step k as the skipped run does at step k + 1
    assert [r["loss"] for r in rolled[SPIKE_STEP - 1 : -1]] == [r["loss"] for r in skipped[SPIKE_STEP:]]
    assert rolled[-1]["skipped_iterations"] == 0
