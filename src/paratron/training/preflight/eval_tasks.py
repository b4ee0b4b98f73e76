"""The harness tasks `train --eval-tasks` names: known to lm-evaluation-harness (or found under
--eval-tasks-include-path) before training starts. What the rest of the run must be for them is a
settings check (`config.checks.eval_tasks`).

The harness is imported only when tasks are asked for, for start-up speed."""

from __future__ import annotations

from paratron.config.schema import Config


def check_eval_task_names(config: Config) -> None:
    """A ConfigError naming the first task the harness does not know."""
    if not config.inference.eval_tasks:
        return
    from paratron.inference.tasks import TRAINING_FLAGS, task_manager  # (start-up speed, docs/architecture.md)

    task_manager(config.inference.eval_tasks, config.inference.eval_tasks_include_path, TRAINING_FLAGS)
