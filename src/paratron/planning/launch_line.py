"""The command lines that run a plan: `paratron train` with the flags that rebuild its settings.

On one machine the command runs as it is. Across machines every node starts its own launcher and
the launchers must meet: `launch_command` gives torchrun's line for each node, meeting through its
c10d rendezvous at an address only the user knows (the placeholders HOST:PORT and JOB, which
`fill_in` explains), and `slurm_command` the one srun line that starts them all in a Slurm
allocation, where `paratron train` finds the nodes and their meeting place itself
(`distributed.launch.slurm_settings`).
"""

from __future__ import annotations

import functools
import shlex
from typing import Any

from paratron.config.fields import all_fields, flag
from paratron.config.loading import build_config, settings_of
from paratron.config.schema import LAUNCH_FIELDS, SECTIONS, Config
from paratron.errors import ConfigError

RENDEZVOUS = "HOST:PORT"
"""Placeholder of the multi-node command: one node's address and a free port on it."""
RUN_ID = "JOB"
"""Placeholder of the multi-node command: the run's name at the rendezvous."""


def nodes_of(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node) of a world of `world_size` devices."""
    nodes = max(1, world_size // gpus_per_node)
    return nodes, world_size // nodes


def launch_command(config: Config, world_size: int, gpus_per_node: int) -> str:
    """The command line that runs `config` on `world_size` devices: `paratron train` on one node,
    torchrun with a c10d rendezvous (HOST:PORT and JOB to fill in) on each of several; every setting
    that differs from the defaults and the model's registry entry, by its flag."""
    nodes, per_node = nodes_of(world_size, gpus_per_node)
    if nodes > 1:
        launch = (
            f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint {RENDEZVOUS} --rdzv-id {RUN_ID} -m paratron train"
        )
    else:
        launch = f"paratron train {flag.nproc_per_node} {per_node}" if per_node > 1 else "paratron train"
    return " ".join([launch, *map(shlex.quote, config_arguments(config))])


def slurm_command(config: Config, world_size: int, gpus_per_node: int) -> str | None:
    """The srun line that starts `config` on every node of a Slurm allocation (one `paratron train`
    per node, which launches the node's processes), or None on one node."""
    nodes, per_node = nodes_of(world_size, gpus_per_node)
    if nodes == 1:
        return None
    launch = f"srun --nodes {nodes} --ntasks-per-node 1 paratron train {flag.nproc_per_node} {per_node}"
    return " ".join([launch, *map(shlex.quote, config_arguments(config))])


def fill_in(world_size: int, gpus_per_node: int) -> str | None:
    """What the user fills in and where the multi-node command runs (None on one node)."""
    nodes, _ = nodes_of(world_size, gpus_per_node)
    if nodes == 1:
        return None
    return (
        f"run it on each of the {nodes} nodes, with {RENDEZVOUS} replaced by one node's address and a free port "
        f"there and {RUN_ID} by a name for the run, the same on every node; under Slurm this one line, in an "
        f"allocation of {nodes} nodes, starts them all:"
    )


def config_arguments(config: Config) -> list[str]:
    """Flags that rebuild `config` (with `build_config`): its settings that differ from the defaults
    and its model's registry entry; planning and launch settings (the launcher's) are left out."""
    flat, baseline = _flat(config), _defaults(config.model.model_name)
    args: list[str] = []
    if config.model.model_name:
        args += [flag.model_name, config.model.model_name]
    for name, info in all_fields().items():
        value = flat[name]
        if name == "model_name" or name in LAUNCH_FIELDS or info.section == "planning" or value == baseline[name]:
            continue
        if info.base_type is bool:
            args.append(info.flag if value else "--no-" + info.flag[2:])
        elif value is None:
            raise ConfigError(f"{info.flag}: a plan cannot unset it on the command line; drop it from the recipe")
        elif info.base_type in (list, tuple):
            args += [info.flag, *map(str, value)]
        else:
            args += [info.flag, str(value)]
    return args


def _flat(config: Config) -> dict[str, Any]:
    """Every setting of `config` by its field name, as saved (derived ones None, tuples as lists)."""
    flat: dict[str, Any] = {}
    for name in SECTIONS:
        section = getattr(config, name)
        known = _SECTION_SETTINGS.get(id(section))
        if known is None or known[0] is not section:
            if len(_SECTION_SETTINGS) >= 4096:
                _SECTION_SETTINGS.clear()
            known = _SECTION_SETTINGS[id(section)] = (section, settings_of(section))
        flat.update(known[1])
    return flat


_SECTION_SETTINGS: dict[int, tuple[Any, dict[str, Any]]] = {}
"""`settings_of` by section (plans of one search share most sections: a few hundred, for thousands of commands)."""


@functools.lru_cache(maxsize=8)
def _defaults(model_name: str | None) -> dict[str, Any]:
    """The settings of the model's registry entry with every other default (read only)."""
    return _flat(build_config({"model_name": model_name}))
