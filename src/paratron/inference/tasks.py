"""lm-evaluation-harness tasks on a paratron model: `paratron evaluate --tasks` and `train --eval-tasks`.

The harness runs in process on the engine's controller through the "paratron" model (`inference/harness.py`); the
model's other ranks follow the engine until the controller closes it. Task names are checked against the harness'
task index (its own tasks and an --include-path folder of YAML files) before any model is built.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

from paratron.config.fields import flag
from paratron.config.inference import InferenceConfig
from paratron.config.layout import Layout
from paratron.config.schema import Config
from paratron.distributed.init import initialize, shutdown
from paratron.distributed.topology import Topology
from paratron.errors import ConfigError
from paratron.inference.harness import ParatronLM
from paratron.inference.loading import engine_for_model, open_engine
from paratron.inference.runner import KEEP_ALIVE_S
from paratron.parallel.model import ParallelModel
from paratron.storage import write_text_atomic

T = TypeVar("T")


TRAINING_FLAGS = (flag.eval_tasks, flag.eval_tasks_include_path)
"""The flags that name `train`'s tasks and their folder, for error lines."""


def task_names(given: str | Sequence[str]) -> tuple[str, ...]:
    """Task names from "a,b" or ["a", "b,c"], in order, each once."""
    parts = [given] if isinstance(given, str) else list(given)
    names = [name.strip() for part in parts for name in part.split(",") if name.strip()]
    return tuple(dict.fromkeys(names))


def task_manager(names: Sequence[str], include_path: str | Path | None, flags: tuple[str, str]) -> TaskManager:
    """The harness' task index holding every one of `names` (only the --include-path folder's tasks when they are
    all there: indexing the harness' own thousands of tasks takes seconds). `flags`: the flags that named the tasks
    and the folder, for the error line."""
    task_flag, path_flag = flags
    if not names:
        raise ConfigError(f"{task_flag} names no task; give one or more names separated by commas")
    if include_path is not None:
        folder = Path(include_path).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"{path_flag} {include_path}: no such folder; give a folder of task YAML files")
        local = TaskManager(include_path=str(folder), include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=str(Path(include_path).expanduser()) if include_path else None)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        where = (
            f"in lm-evaluation-harness or {path_flag} {include_path}" if include_path else "in lm-evaluation-harness"
        )
        hint = f"; or add its YAML file to a folder given with {path_flag}" if not include_path else ""
        raise ConfigError(
            f"{task_flag}: no task named {', '.join(unknown)} {where}; check the name (`lm-eval ls tasks` lists "
            f"them){hint}"
        )
    return manager


def on_controller(engine: Any, work: Callable[[], T]) -> T | None:
    """`work()` on the engine's controller, the model's other ranks following the engine meanwhile; the engine is
    closed after (its followers return). None on the followers."""
    if not engine.is_controller:
        engine.follow()
        return None
    try:
        return work()
    finally:
        engine.close()


class _TakingTurns:
    """The engine as the harness' model uses it: its `generate` waits for the keep-alive thread's turn to end."""

    def __init__(self, engine: Any, lock: threading.Lock) -> None:
        self._engine, self._lock = engine, lock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._engine.generate(*args, **kwargs)


@contextlib.contextmanager
def kept_alive(engine: Any, every_s: float | None = None) -> Iterator[Any]:
    """The engine, with a thread telling its waiting ranks every `every_s` seconds that the controller is still
    there (`Engine.keep_alive`) whenever no `generate` runs: building a task (its dataset, few-shot examples) or
    scoring its answers can take longer than a collective may wait. The engine itself is not thread-safe: the two
    take turns. `every_s`: default `KEEP_ALIVE_S`."""
    lock, done = threading.Lock(), threading.Event()
    every_s = every_s or KEEP_ALIVE_S

    def beat() -> None:
        while not done.wait(every_s):
            with lock:
                engine.keep_alive()

    thread = threading.Thread(target=beat, name="engine keep-alive", daemon=True)
    thread.start()
    try:
        yield _TakingTurns(engine, lock)
    finally:
        done.set()
        thread.join()


def evaluate_engine(
    engine: Any,
    names: Sequence[str],
    manager: TaskManager,
    num_fewshot: int | None = None,
    limit: int | None = None,
    bootstrap_iters: int = 100_000,
    log_samples: bool = False,
) -> dict[str, Any]:
    """The harness' results dictionary for `names` on the engine's model (call on the controller; the model's other
    ranks are kept waiting while the harness builds its tasks and scores its answers, `kept_alive`)."""
    with kept_alive(engine) as shared:
        results = simple_evaluate(
            model=ParatronLM(shared),
            tasks=list(names),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
        )
    assert results is not None  # (None only on ranks other than 0 of the harness' own distribution)
    return results


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The results' metrics as flat keys: `<task>/<metric>` (and `/<filter>` for a filter other than "none"),
    standard errors left out, only finite numbers."""
    metrics: dict[str, float] = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if not kind or metric.endswith("_stderr") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                suffix = "" if kind == "none" else f"/{kind}"
                metrics[f"{task}/{metric}{suffix}"] = float(value)
    return metrics


def results_json(results: dict[str, Any]) -> str:
    """The results as the harness writes them (what JSON cannot hold, as text)."""
    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"


def results_tables(results: dict[str, Any]) -> str:
    """The harness' results table (and its groups table, when a group was run)."""
    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)


def run_tasks(
    config: Config,
    names: Sequence[str],
    num_fewshot: int | None = None,
    include_path: str | Path | None = None,
    limit: int | None = None,
    output: Path | None = None,
    bootstrap_iters: int = 100_000,
    log_samples: bool = False,
    log: Callable[[str], None] = print,
    layout: Layout | None = None,
) -> dict[str, Any] | None:
    """`paratron evaluate --tasks`: the --load checkpoint on the harness' tasks at config's layout (every rank of
    the model takes part). Prints the results table and writes `output` (JSON) on rank 0; returns the results there
    (with each document's requests and answers under "samples" with `log_samples`), None elsewhere. `layout`: the
    one validation worked out (`open_engine`)."""
    manager = task_manager(names, include_path, ("--tasks", "--include-path"))
    owned = not dist.is_initialized()
    ctx = initialize(config.parallel.distributed_backend, config.parallel.distributed_timeout_minutes)
    try:
        say = log if ctx.is_main else (lambda *a, **k: None)
        engine = open_engine(config, log=say, layout=layout)
        results = on_controller(
            engine, lambda: evaluate_engine(engine, names, manager, num_fewshot, limit, bootstrap_iters, log_samples)
        )
        if results is None:
            return None
        say(results_tables(results))
        if output is not None:
            write_text_atomic(
                output, results_json(results), "the task results", "free space or choose another --output"
            )
            say(f"wrote {output}")
        return results
    finally:
        if owned:
            shutdown()


class TrainingTasks:
    """`train --eval-tasks`: the harness' tasks on the training model (`engine_for_model`), every evaluation. Each
    data-parallel replica builds an engine on its model-parallel ranks; the first replica runs the tasks while the
    others close theirs at once (their numbers would be the same)."""

    def __init__(self, settings: InferenceConfig) -> None:
        self.settings = settings
        self.names = task_names(settings.eval_tasks)
        self.manager: TaskManager | None = None
        """The task index, built on first use on the rank that runs the harness."""

    def evaluate(
        self, model: ParallelModel, tokenizer: Any, topology: Topology, progress: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """The tasks' metrics (`task_metrics`) on the replica's controller that ran them; {} on every other rank.
        The model runs in evaluation mode (no dropout), and goes back to the mode it was in. `progress` is told of
        every engine step and keep-alive, on every rank (the run's watchdog)."""
        training = model.module.training
        model.module.eval()
        try:
            return self._run(model, tokenizer, topology, progress)
        finally:
            model.module.train(training)

    def _run(
        self, model: ParallelModel, tokenizer: Any, topology: Topology, progress: Callable[[], None] | None
    ) -> dict[str, float]:
        s = self.settings
        engine = engine_for_model(model, tokenizer, s, topology, progress=progress)

        def run() -> dict[str, float]:
            if topology.dp_rank != 0:
                return {}
            if self.manager is None:
                self.manager = task_manager(self.names, s.eval_tasks_include_path, TRAINING_FLAGS)
            results = evaluate_engine(
                engine, self.names, self.manager, s.eval_tasks_num_fewshot, s.eval_tasks_limit, bootstrap_iters=0
            )
            return task_metrics(results)

        return on_controller(engine, run) or {}
