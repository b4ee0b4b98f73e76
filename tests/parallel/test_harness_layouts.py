"""lm-evaluation-harness tasks give the same numbers at tensor and pipeline parallel layouts as on one process:
`paratron evaluate --tasks`' `run_tasks` on a checkpoint, and `train --eval-tasks` on the training model (also with
two data-parallel replicas)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from harness_tasks import TASKS, checkpoints, write_tasks
from paratron.config import build_config
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.inference import tasks as inference_tasks
from paratron.inference.tasks import run_tasks
from paratron.training.run import run_training

from tiny import no_loss_plot

LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2)}


def flat(value: Any) -> list:
    """Nested answers as one list of numbers (is-greedy flags as 0 and 1) and texts."""
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in flat(part)]
    return [value if isinstance(value, str) else float(value)]


def summary(results: dict[str, Any] | None) -> dict[str, Any] | None:
    """Each task's numeric metrics and each document's answers, flat (picklable, comparable)."""
    if results is None:
        return None
    answers = {
        task: flat([s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])])
        for task, samples in results["samples"].items()
    }
    metrics = {
        task: {k: float(v) for k, v in values.items() if "," in k and not isinstance(v, str)}
        for task, values in results["results"].items()
    }
    return {"answers": answers, "metrics": metrics}


def tasks_at(checkpoint: str, tasks: str, overrides: dict) -> dict[str, Any] | None:
    config = build_config(dict(load=checkpoint, **overrides))
    return summary(run_tasks(config, TASKS, 2, tasks, bootstrap_iters=0, log_samples=True, log=lambda *_: None))


def trained_metrics(checkpoint: str, tasks: str, run_dir: str, overrides: dict) -> list[dict[str, float]]:
    """The task metrics `train --eval-tasks` logs (lr 0: the checkpoint's own)."""
    text = Path(run_dir) / "text.txt"
    settings = dict(
        load=checkpoint,
        data_path=[str(text)],
        seq_length=32,
        micro_batch_size=2,
        train_iters=2,
        lr=0.0,
        min_lr=0.0,
        eval_interval=2,
        eval_iters=0,
        eval_tasks=("tiny_choice", "tiny_rolling"),
        eval_tasks_include_path=tasks,
        run_dir=run_dir,
        progress_bar=False,
        tensorboard=False,
        log_interval=1,
        **overrides,
    )
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    text.write_text("alpha beta gamma delta epsilon zeta eta theta\n" * 50, encoding="utf-8")
    with no_loss_plot():
        run_training(build_config(settings, recipe=f"{checkpoint}/model.yaml"))
    metrics = Path(run_dir) / "metrics.jsonl"
    if dist.is_initialized() and dist.get_rank() != 0:  # (rank 0 writes the metrics)
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("tasks/")} for r in records if r["step"] == 2]


def at_layouts(checkpoint: str, tasks: str, run_dir: str) -> dict[str, Any]:
    """run_tasks and a training run at each layout, one after the other on one process group; the controller's
    keep-alive messages come every 10 ms, between the harness' requests."""
    initialize("gloo")
    inference_tasks.KEEP_ALIVE_S = 0.01
    found: dict[str, Any] = {}
    for name, overrides in LAYOUTS.items():
        found[name] = tasks_at(str(Path(checkpoint) / "iter_0000000"), tasks, overrides)
        found[f"train-{name}"] = trained_metrics(checkpoint, tasks, f"{run_dir}/{name}", overrides)
    found["train-dp2"] = trained_metrics(checkpoint, tasks, f"{run_dir}/dp2", {})  # (the first replica runs them)
    return found


def test_tasks_give_the_same_numbers_at_tensor_and_pipeline_parallel_layouts(tmp_path):
    checkpoint, _ = checkpoints(tmp_path)
    tasks = str(write_tasks(tmp_path / "tasks"))
    single = tasks_at(str(checkpoint), tasks, {})
    trained = trained_metrics(str(checkpoint.parent), tasks, str(tmp_path / "single"), {})
    assert trained and trained[0]["tasks/tiny_choice/acc"] == single["metrics"]["tiny_choice"]["acc,none"]
    found = run_ranks(at_layouts, 2, str(checkpoint.parent), tasks, str(tmp_path))
    assert found[1] == {name: None for name in LAYOUTS} | {f"train-{name}": [] for name in [*LAYOUTS, "dp2"]}
    for name in LAYOUTS:
        ours = found[0][name]
        assert ours["answers"]["tiny_answer"] == single["answers"]["tiny_answer"], name
        for task in ("tiny_choice", "tiny_rolling"):
            assert ours["answers"][task] == pytest.approx(single["answers"][task], abs=1e-4), (name, task)
            assert ours["metrics"][task] == pytest.approx(single["metrics"][task], rel=1e-5), (name, task)
    for name in [*LAYOUTS, "dp2"]:
        assert found[0][f"train-{name}"] == [pytest.approx(trained[0], rel=1e-5)], name
