"""What the commands that start workers share (train, evaluate, generate, serve): the settings and input
files checked before any worker starts, then this node's workers under torchrun; the launcher's quiet C++ log.
`paratron.cli` reads the log's names from here, so this module imports nothing else of the package until a
command launches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from paratron.errors import UserError

if TYPE_CHECKING:  # (the schema itself is imported when a command launches)
    from paratron.config.layout import Layout
    from paratron.config.schema import Config

CPP_LOG_LEVEL, USER_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL", "PARATRON_USER_CPP_LOG_LEVEL"


def quiet_launcher_logs() -> None:
    """Keep torch's C++ log (a stack trace per failed connection to the rendezvous) out of the
    launch agent, which reports failures in one line; the workers get the user's level back
    (`paratron.cli.main`). Before torch is imported, which reads it once; a second call changes nothing."""
    if USER_CPP_LOG_LEVEL in os.environ:
        return
    os.environ[USER_CPP_LOG_LEVEL] = os.environ.get(CPP_LOG_LEVEL, "")
    os.environ[CPP_LOG_LEVEL] = "FATAL"


HANDED_OVER_ENV = "PARATRON_LAUNCHED_RUN"
"""The file in which a launcher leaves the settings and the layout it checked, for the workers it starts."""


def check_and_launch(
    config: Config, argv: list[str], origins: dict[str, str] | None = None
) -> tuple[int | None, Config, Layout]:
    """Validate the settings and the input files before any worker starts; with --nproc N (and not
    started by torchrun) run `paratron ARGV` under torchrun and return its exit code, else None:
    this process is a worker and goes on, with the settings returned (fitted to this machine's
    GPUs) and the run's layout validation worked out for them, which the worker passes down. A
    worker this launcher started takes the launcher's settings and layout as they were checked
    (`handed_over`), and checks nothing again. `origins`: where settings came from
    (`Resolution.origins`), for the error line."""
    from paratron.config.loading import explain_origins  # (start-up speed, docs/architecture.md: cli imports this)
    from paratron.distributed.init import computing_device_type, env_world_size, fit_to_devices, launched_by_torchrun
    from paratron.distributed.launch import needs_agent, run_under_torchrun, slurm_settings
    from paratron.training.preflight import check_before_launch

    torchrun = launched_by_torchrun()
    handed = handed_over() if torchrun else None
    if handed is not None:
        return None, *handed
    resolved = config  # (remembers where its settings came from)
    if not torchrun:
        config = dataclasses.replace(config, parallel=slurm_settings(os.environ, config.parallel))
        config, argv = fit_to_devices(config, argv)  # (one process per GPU, counted before any starts)
    p = config.parallel
    try:
        world_size = env_world_size() if torchrun else p.nproc_per_node * p.nnodes
        layout = check_before_launch(config, world_size, computing_device_type(p.distributed_backend))
    except UserError as exc:  # say which settings a recipe, a preset or the checkpoint gave
        raise type(exc)(explain_origins(str(exc), origins or {}, resolved, config)) from None
    if needs_agent(p) and not torchrun:
        from paratron.checkpoint.lock import held_for_the_launch

        with held_for_the_launch(config.checkpoint.save if argv[0] == "train" else None, p):  # one writer
            with _handing_over(config, layout):
                return run_under_torchrun(p, argv), config, layout
    return None, config, layout


@contextlib.contextmanager
def _handing_over(config: Config, layout: Layout) -> Iterator[None]:
    """While the workers run: the settings and layout this launcher checked, in a file they read
    (`handed_over`) instead of resolving and checking the command line again."""
    from paratron.config.loading import config_to_dict  # (start-up speed, docs/architecture.md: cli imports this)

    with tempfile.TemporaryDirectory(prefix="paratron-run-") as folder:
        path = Path(folder) / "run.json"
        path.write_text(json.dumps({"config": config_to_dict(config), "layout": layout.to_dict()}), encoding="utf-8")
        os.environ[HANDED_OVER_ENV] = str(path)
        try:
            yield
        finally:
            del os.environ[HANDED_OVER_ENV]


def handed_over() -> tuple[Config, Layout] | None:
    """In a worker its launcher started: the settings and layout the launcher checked; None in a
    process started otherwise (alone, or by a user's torchrun), which resolves its own."""
    from paratron.config.layout import Layout  # (start-up speed, docs/architecture.md: cli imports this)
    from paratron.config.loading import config_from_dict

    where = os.environ.get(HANDED_OVER_ENV)
    if where is None:
        return None
    run = json.loads(Path(where).read_text(encoding="utf-8"))
    return config_from_dict(run["config"]), Layout.from_dict(run["layout"])
