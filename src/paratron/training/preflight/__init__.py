"""The checks made before any worker starts, once each and in order, so that a bad setting or input ends
with one line and exit code 2 while nothing runs yet (docs/architecture.md, "Clear failure").

`check_before_launch` is the one pass `paratron train` (and evaluate, generate, serve) makes:

1. the settings, group by group (`config.validation.validate`, the groups in `config.checks`), which
   also works out the run's `Layout`;
2. the inputs: the checkpoint to load (`checkpoint`), the data files and Megatron-LM's loader flags
   (`data_files`), the tokenizer's files (`tokenizer_files`), the logging (`logging_settings`), the
   harness tasks of --eval-tasks (`eval_tasks`);
3. the device: fp8 matmuls where --fp8-format asks for them (`parallel.fp8.check_fp8`).

The settings checks live in `config` because the planner and the device fitting validate settings
without reading any file.
"""

from __future__ import annotations

from paratron.config.layout import Layout
from paratron.config.schema import Config
from paratron.config.validation import validate
from paratron.parallel.fp8 import check_fp8
from paratron.training.preflight.checkpoint import check_checkpoint_to_load, uses_saved_tokenizer
from paratron.training.preflight.data_files import check_data_inputs
from paratron.training.preflight.eval_tasks import check_eval_task_names
from paratron.training.preflight.logging_settings import check_logging_settings


def check_before_launch(config: Config, world_size: int, device_type: str) -> Layout:
    """Every check of a run on `world_size` processes whose devices are of `device_type` (cuda, cpu, ...),
    each once; raise the first failure (a UserError, one line); return the run's layout."""
    layout = validate(config, world_size)
    check_inputs(config)
    check_fp8(config.training, device_type)
    return layout


def check_inputs(config: Config) -> None:
    """Cheap checks of what a run will read: the checkpoint to load (it exists and is complete), the data and
    tokenizer files, the logging it asks for, and the harness tasks it evaluates."""
    info = check_checkpoint_to_load(config)
    check_data_inputs(config, saved_tokenizer=uses_saved_tokenizer(config, info))
    check_logging_settings(config)
    check_eval_task_names(config)
