"""The shape of a run is worked out once: the `Layout` carries the one `ParallelDims` (data-parallel sizes are
computed there alone), a bad expert grid is the ConfigError validation names, the batch plans are the layout's
per-rank views, a worker trains with the layout its entry validated instead of resolving it again, and a worker
its launcher started takes the settings and layout the launcher checked, resolving and checking nothing."""

from __future__ import annotations

import pytest

import paratron.commands.train as train_command
import paratron.training.preflight as preflight
import paratron.training.run as run
from paratron.cli import main
from paratron.commands.launching import _handing_over, check_and_launch
from paratron.config import build_config
from paratron.config.dims import ParallelDims
from paratron.config.layout import BatchPlan, Layout, resolve_layout
from paratron.config.validation import validate
from paratron.errors import ConfigError

SHAPES = [
    dict(nproc_per_node=8),
    dict(nproc_per_node=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    dict(nproc_per_node=8, num_experts=4, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
    dict(nproc_per_node=8, num_experts=4, expert_model_parallel_size=2, tensor_model_parallel_size=2),
    dict(
        nproc_per_node=8,
        num_experts=4,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=4,
        tensor_model_parallel_size=2,
    ),
    dict(nproc_per_node=8, num_experts=4, expert_model_parallel_size=4, context_parallel_size=2, seq_length=64),
]


def _config(settings: dict):
    return build_config(dict(mock_data=True, **settings), recipe="debug")


@pytest.mark.parametrize("settings", SHAPES)
def test_the_layout_reads_every_size_from_its_dims(settings):
    config = _config(settings)
    layout = validate(config, 8)
    dims = layout.dims
    assert dims == ParallelDims.from_config(8, config.parallel)
    sizes = ("world_size", "tp", "pp", "cp", "ep", "dp", "edp")
    assert [getattr(layout, name) for name in sizes] == [getattr(dims, name) for name in sizes]
    assert layout.etp == dims.expert_tp
    assert dims.expert_tp * dims.ep * dims.edp == dims.tp * dims.cp * dims.dp


def test_data_parallel_size_is_computed_in_the_dims_alone(monkeypatch):
    layout = resolve_layout(_config(dict(nproc_per_node=8, tensor_model_parallel_size=2)), 8)
    monkeypatch.setattr(ParallelDims, "dp", property(lambda self: 1))
    monkeypatch.setattr(ParallelDims, "edp", property(lambda self: 2))
    assert (layout.dp, layout.edp) == (1, 2)
    assert layout.batches(0).dp_size == 1


@pytest.mark.parametrize(
    "settings, expected",
    [
        (
            dict(num_experts=4, expert_model_parallel_size=4, tensor_model_parallel_size=2, nproc_per_node=4),
            "--expert-model-parallel-size 4 x expert tensor-parallel size 2 = 8 does not divide the 4 ranks of a "
            "pipeline stage (TP 2 x CP 1 x DP 2), over which the experts' grid is laid; choose sizes whose product "
            "divides it",
        ),
        (
            dict(num_experts=4, expert_tensor_parallel_size=3, tensor_model_parallel_size=2, nproc_per_node=2),
            "--expert-tensor-parallel-size 3 does not divide the 2 ranks of a pipeline stage (TP 2 x CP 1 x DP 1); "
            "choose a divisor",
        ),
        (
            dict(num_experts=6, expert_model_parallel_size=4, nproc_per_node=2),
            "--num-experts 6 is not divisible by --expert-model-parallel-size 4; choose an expert-parallel size "
            "that divides the number of experts",
        ),
    ],
)
def test_a_bad_expert_grid_is_the_validation_error(settings, expected):
    config = _config(settings)
    world = config.parallel.nproc_per_node
    with pytest.raises(ConfigError) as resolved:
        resolve_layout(config, world)
    with pytest.raises(ConfigError) as validated:
        validate(config, world)
    assert str(resolved.value) == str(validated.value) == expected


def test_batch_plans_are_the_layouts_per_rank_views():
    layout = resolve_layout(_config(dict(nproc_per_node=4, micro_batch_size=2, global_batch_size=16)), 4)
    assert layout.batches(3) == BatchPlan(16, 2, 4, 3)
    assert layout.num_micro_batches == layout.batches(0).num_micro_batches == 2
    assert layout.batches(1, global_batch_size=8).num_micro_batches == 1  # (a batch-size ramp's step)


def test_the_worker_trains_with_the_layout_its_entry_validated(monkeypatch, tmp_path):
    validated: list[Layout] = []
    used: list[Layout] = []
    check = preflight.check_before_launch

    def remembered(*args, **kwargs) -> Layout:
        validated.append(check(*args, **kwargs))
        return validated[-1]

    def refuse(*args, **kwargs):
        raise AssertionError("the worker resolved the layout again")

    topology = run.worker_topology
    monkeypatch.setattr(preflight, "check_before_launch", remembered)
    monkeypatch.setattr(run, "resolve_layout", refuse)
    monkeypatch.setattr(run, "worker_topology", lambda layout, *a: used.append(layout) or topology(layout, *a))
    args = ["train", "--config", "debug", "--mock-data", "--train-iters", "1", "--micro-batch-size", "2"]
    args += ["--global-batch-size", "4", "--seq-length", "16", "--hidden-size", "32", "--eval-iters", "0"]
    args += ["--run-dir", str(tmp_path), "--no-progress-bar", "--data-cache-path", str(tmp_path / "cache")]
    assert main(args) == 0
    assert len(validated) == 1 and used == validated and used[0] is validated[0]
    assert used[0].num_micro_batches == 2


@pytest.mark.parametrize("settings", SHAPES)
def test_a_layout_reads_back_from_what_the_launcher_writes(settings):
    layout = resolve_layout(_config(settings), settings["nproc_per_node"])
    assert Layout.from_dict(layout.to_dict()) == layout


def test_a_worker_its_launcher_started_takes_the_checked_settings_and_layout(monkeypatch):
    settings = dict(nproc_per_node=2, tensor_model_parallel_size=2, micro_batch_size=2, global_batch_size=8)
    config = _config(settings)
    layout = validate(config, 2)
    trained = []

    def refuse(*args, **kwargs):
        raise AssertionError("the worker resolved or checked its settings again")

    monkeypatch.setattr(run, "run_training", lambda *handed: trained.append(handed))
    monkeypatch.setattr(train_command, "train_settings", refuse)
    monkeypatch.setattr(preflight, "check_before_launch", refuse)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with _handing_over(config, layout):
        assert main(["train", "--config", "no-such-recipe"]) == 0  # (its flags are not read)
        # evaluate's, generate's and serve's workers read their own options, then take the launcher's settings
        other = _config(dict(settings, global_batch_size=4))
        assert check_and_launch(other, ["evaluate"]) == (None, config, layout)
    assert trained == [(config, layout)]


def test_auto_resolves_the_settings_once_and_trains_the_plan(monkeypatch, tmp_path, capsys):
    resolved, trained = [], []
    resolve = train_command.train_settings
    monkeypatch.setattr(train_command, "train_settings", lambda argv: resolved.append(argv) or resolve(argv))
    monkeypatch.setattr(run, "run_training", lambda *args: trained.append(args))
    args = ["train", "--config", "debug", "--mock-data", "--auto", "--train-iters", "2", "--run-dir", str(tmp_path)]
    assert main(args) == 0
    assert len(resolved) == 1
    ((config, layout),) = trained
    chosen = capsys.readouterr().out.splitlines()[0]
    assert chosen.startswith("--auto: TP1 CP1 PP1 DP1 ") and not config.planning.auto
    assert config.training.global_batch_size == layout.global_batch_size
    assert (
        f" mbs{config.training.micro_batch_size} " in chosen
        and layout.micro_batch_size == config.training.micro_batch_size
    )
