"""Megatron-LM's logging, profiling and run-control flags: the values they log are right (against
torch, hand counts and exp(loss)), they reach metrics.jsonl, TensorBoard and wandb, the profiler
traces the steps asked for, and MFU stays a fraction."""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.errors import ConfigError
from paratron.model.gpt import build_model
from paratron.training.flops import bounded_mfu, peak_flops
from paratron.training.preflight.logging_settings import check_logging_settings
from paratron.training.run import run_training

from tiny import LLAMA_STYLE, tiny_config

STEPS, SEQ, HIDDEN, MAX_POSITIONS = 4, 32, 64, 256  # the debug recipe's model, sequences of 32
ALL_FLAGS = dict(
    train_iters=STEPS,
    lr=0.0,  # (the weights stay the initial ones: their norm is known without the run)
    min_lr=0.0,  # (the recipe's 1e-3 would be the floor of a schedule from 0)
    add_bias_linear=False,  # (a key bias's gradient is zero in exact arithmetic: ~1e-12 noise, sometimes 0)
    tensorboard=True,
    eval_iters=1,
    eval_interval=2,
    log_params_norm=True,
    log_num_zeros_in_grad=True,
    log_throughput=True,
    log_validation_ppl_to_tensorboard=True,
    log_timers_to_tensorboard=True,
    timing_log_level=2,
    log_memory_to_tensorboard=True,
    log_world_size_to_tensorboard=True,
    profile=True,
    profile_step_start=2,
    profile_step_end=4,
    wandb_project="paratron-test",
    wandb_exp_name="tiny",
)


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records what a run logs."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.init_kwargs: dict[str, Any] = {}
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.finished = False

    def init(self, **kwargs: Any) -> FakeWandb:
        self.init_kwargs = kwargs
        return self

    def log(self, values: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(values)))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture(scope="module")
def flagged_run(tmp_path_factory) -> dict[str, Any]:
    """One 4-step run with every logging flag on, wandb faked, validation every 2 steps."""
    run_dir = tmp_path_factory.mktemp("flags")
    fake = FakeWandb()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "wandb", fake)
        patch.delenv("WANDB_MODE", raising=False)
        config = tiny_config(run_dir, **ALL_FLAGS)
        run_training(config)
        wandb_mode = os.environ.get("WANDB_MODE")
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    events = EventAccumulator(str(next((run_dir / "tensorboard").glob("events.out.tfevents.*"))))
    events.Reload()
    return dict(config=config, dir=run_dir, records=records, events=events, wandb=fake, wandb_mode=wandb_mode)


def test_params_norm_is_the_single_device_norm(flagged_run):
    config = flagged_run["config"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (where the run initialised them)
    model = build_model(config.model, device, seed=config.training.seed)  # = the run's weights (lr 0)
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().norm().item()
    for record in flagged_run["records"]:
        assert record["params_norm"] == pytest.approx(expected, rel=1e-6)
    logged = flagged_run["events"].Scalars("train/params_norm")
    assert [e.step for e in logged] == [1, 2, 3, 4] and logged[-1].value == pytest.approx(expected, rel=1e-6)


def test_num_zeros_in_grad_is_the_hand_count(flagged_run):
    # the position embeddings past the sequence get no gradient; every other entry's is non-zero
    expected = (MAX_POSITIONS - SEQ) * HIDDEN
    zeros = [r["num_zeros_in_grad"] for r in flagged_run["records"]]
    assert zeros == [expected] * STEPS
    assert [e.value for e in flagged_run["events"].Scalars("train/num_zeros_in_grad")] == zeros


def test_validation_perplexity_is_exp_of_the_loss_in_tensorboard(flagged_run):
    events = flagged_run["events"]
    losses, ppls = events.Scalars("valid/loss"), events.Scalars("valid/ppl")
    assert [e.step for e in ppls] == [2, 4] == [e.step for e in losses]
    for loss, ppl in zip(losses, ppls):
        assert ppl.value == pytest.approx(math.exp(loss.value), rel=1e-5)
        assert 100 < ppl.value < 2000  # (a vocabulary of 512, untrained)


def test_timers_memory_and_sizes_are_logged(flagged_run):
    record = flagged_run["records"][-1]
    for name in ("forward-backward", "optimizer", "optimizer-inner-step", "batch-generator", "all-grads-sync"):
        assert 0 <= record[f"{name}-time-min"] <= record[f"{name}-time"] < 10, name
    assert record["forward-backward-time"] < record["iteration-time"]
    assert record["optimizer-inner-step-time"] <= record["optimizer-time"]
    assert record["batch_size"] == 8 and record["world_size"] == 1
    assert 1e6 < record["mem_allocated_bytes"] <= record["mem_max_allocated_bytes"]
    assert record["throughput"] == pytest.approx(record["tflops_per_device"])
    tags = set(flagged_run["events"].Tags()["scalars"])
    assert {"train/forward-backward-time", "train/iteration-time", "train/lr", "train/throughput"} <= tags


def test_profiler_traces_only_the_asked_steps(flagged_run):
    (trace,) = (flagged_run["dir"] / "tensorboard").glob("profile_rank0_steps2-4.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("name") == "aten::mm" or e.get("name") == "aten::addmm" for e in events)


def test_wandb_gets_the_scalars_offline(flagged_run):
    fake = flagged_run["wandb"]
    assert flagged_run["wandb_mode"] == "offline" and fake.finished
    assert fake.init_kwargs["project"] == "paratron-test" and fake.init_kwargs["name"] == "tiny"
    assert fake.init_kwargs["config"]["training"]["train_iters"] == STEPS
    by_step: dict[int, dict[str, float]] = {}
    for step, values in fake.logged:
        by_step.setdefault(step, {}).update(values)
    for record in flagged_run["records"]:
        assert by_step[record["step"]]["train/loss"] == pytest.approx(record["loss"])
        assert by_step[record["step"]]["train/params_norm"] == pytest.approx(record["params_norm"])
    assert "valid/ppl" in by_step[4]


def test_missing_wandb_is_a_one_line_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # (import wandb fails)
    with pytest.raises(ConfigError, match="pip install wandb") as error:
        check_logging_settings(tiny_config(tmp_path, wandb_project="p"))
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="profiling needs 1 <= start < end"):
        check_logging_settings(tiny_config(tmp_path, profile=True, profile_step_start=5, profile_step_end=5))


def bf16_llama_records(run_dir: Path, **overrides: Any) -> list[dict[str, Any]]:
    run_training(tiny_config(run_dir, train_iters=2, precision="bf16", micro_batch_size=4, **LLAMA_STYLE, **overrides))
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_mfu_stays_a_fraction_in_bf16(tmp_path, capsys):
    peak, source = peak_flops(torch.device("cpu"), None, "bf16")
    assert source == "bfloat16 matmul probe"  # (an fp32 probe understates a bf16 run's peak several times)
    assert all(0 < r["mfu"] <= 1 for r in bf16_llama_records(tmp_path / "probed"))
    # a peak far below what the CPU does (a probe made on a busy machine): MFU is capped, with one warning
    capsys.readouterr()
    capped = [r["mfu"] for r in bf16_llama_records(tmp_path / "low", peak_tflops=1e-6)]
    assert capped[0] == 1.0 and 0 < capped[1] <= 1  # (step 2 is measured against step 1's speed, or is faster)
    assert capsys.readouterr().out.count("above the peak") == 1
    assert bounded_mfu(2.0, 4.0) == (0.5, 4.0, False) and bounded_mfu(5.0, 4.0) == (1.0, 5.0, True)


def test_without_the_nan_check_a_nonfinite_step_is_applied(tmp_path):
    config = tiny_config(tmp_path, train_iters=3, check_for_nan_in_loss_and_grad=False, fault_inject=["0:2:nan"])
    run_training(config)  # (with the check, the default, this stops with NonFiniteStop)
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "metrics.jsonl")]
    assert math.isfinite(losses[0]) and math.isnan(losses[1]) and math.isnan(losses[2])  # the NaN reached the weights


def test_manual_gc_deterministic_mode_and_progress_log(tmp_path, monkeypatch):
    seen: list[tuple[bool, bool]] = []  # (automatic gc on, deterministic algorithms on) at each collection
    collect = gc.collect

    def watched_collect(*args: Any) -> int:
        seen.append((gc.isenabled(), torch.are_deterministic_algorithms_enabled()))
        return collect(*args)

    monkeypatch.setattr(gc, "collect", watched_collect)
    config = tiny_config(
        tmp_path,
        train_iters=4,
        manual_gc=True,
        manual_gc_interval=2,
        eval_iters=1,
        eval_interval=4,
        deterministic_mode=True,
        empty_unused_memory_level=2,
        log_progress=True,
        save=str(tmp_path / "ckpt"),
    )
    run_training(config)
    assert len(seen) >= 5 and all(state == (False, True) for state in seen[:5])  # start, steps 2 and 4, eval x2
    assert gc.isenabled() and not torch.are_deterministic_algorithms_enabled()  # (as they were)
    lines = (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()
    assert lines[0].endswith("# GPUs: 1\tStarting job")
    assert "Saved checkpoint\tIteration: 4\t" in lines[1] and "Floating-point operations: " in lines[1]


SHARDED = dict(train_iters=2, lr=0.0, add_bias_linear=False, micro_batch_size=4, global_batch_size=8)
SHARDED.update(distributed_backend="gloo")  # (2 ranks on the CPU, also where one GPU is)
SHARDED.update(log_params_norm=True)
SHARDED.update(log_num_zeros_in_grad=True, timing_log_level=1, timing_log_option="all")
LAYOUTS = {  # (on 2 ranks) replicated across TP; data-parallel shards; the tied embedding on two stages
    "tp2": dict(tensor_model_parallel_size=2),
    "dp2-zero1": dict(use_distributed_optimizer=True),
    "pp2": dict(pipeline_model_parallel_size=2),
}


def records_of(run_dir: Path, **overrides: Any) -> list[dict[str, Any]]:
    """Train the debug recipe with `overrides`; its metrics.jsonl (empty on ranks that write none)."""
    run_training(tiny_config(run_dir, **overrides))
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def sharded_records(run_dir: str) -> dict[str, list[dict[str, Any]]]:
    """Each layout's records, one after the other on one process group (one spawn for all)."""
    initialize("gloo")
    return {name: records_of(Path(run_dir) / name, **SHARDED, **layout) for name, layout in LAYOUTS.items()}


@pytest.mark.spawns
def test_params_norm_and_zeros_count_every_shard_once(tmp_path):
    reference = records_of(tmp_path / "one", **SHARDED)
    assert reference[0]["num_zeros_in_grad"] == (MAX_POSITIONS - SEQ) * HIDDEN
    for name, records in run_ranks(sharded_records, 2, str(tmp_path))[0].items():
        for ours, one in zip(records, reference, strict=True):
            assert ours["params_norm"] == pytest.approx(one["params_norm"], rel=1e-6), name
            assert ours["num_zeros_in_grad"] == one["num_zeros_in_grad"], name
            assert len(ours["forward-backward-time"]) == 2, name  # (--timing-log-option all: one per rank)
