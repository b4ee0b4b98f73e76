"""`paratron train --auto`: train with the planner's top layout for this machine.

The launching process plans once, before any worker starts, and hands the settings with the chosen
layout to its workers (`commands.launching`), so every rank runs the same layout (the CPU's measured
speed varies from run to run, so ranks must not plan on their own). The hardware is this machine's: a
known GPU's preset with the device's real memory, or the CPU measured on the spot for the processes
that will share it.
"""

from __future__ import annotations

import dataclasses

from paratron.config.fields import all_fields, flag
from paratron.config.loading import build_config, override
from paratron.config.schema import Config, PlanningConfig
from paratron.distributed.init import accelerator_memory_bytes, accelerator_name, choose_backend
from paratron.errors import ConfigError
from paratron.planning.calibration import calibrate, read_calibration
from paratron.planning.hardware import PRESETS, Hardware, hardware_from
from paratron.planning.search import LAYOUT_FIELDS, Plan, plan

GPU_PRESETS = {"B200": "gb200", "H200": "h200-141g", "H100": "h100-80g", "A100": "a100-80g"}
"""Device-name fragment -> the preset whose speeds an unlisted size of that GPU shares."""


def machine_hardware(processes: int) -> Hardware:
    """This machine for `processes` local ranks."""
    _, device = choose_backend("auto")
    name = accelerator_name(device)
    if name is None:
        return hardware_from(PlanningConfig(hardware="cpu"), gpus_per_node=processes)
    preset = next((p for fragment, p in GPU_PRESETS.items() if fragment in name), "h100-80g")
    memory = accelerator_memory_bytes(device) or PRESETS[preset].device_memory_bytes
    return dataclasses.replace(PRESETS[preset], name=name, gpus_per_node=processes, device_memory_gb=memory / 1e9)


def _given_layout_flags(argv: list[str]) -> list[str]:
    fields = all_fields()
    flags = {fields[name].flag for name in LAYOUT_FIELDS}
    return [a.split("=")[0] for a in argv if a.split("=")[0] in flags]


def auto_layout(config: Config, argv: list[str], world_size: int) -> tuple[Config, list[str], Plan]:
    """The settings with the top plan's layout, `argv` with --auto replaced by its layout flags (what the
    workers' command lines show), and that plan."""
    given = _given_layout_flags(argv)
    if given:
        raise ConfigError(f"{flag.auto} chooses the layout itself; drop {', '.join(given)} (or drop {flag.auto})")
    hardware = machine_hardware(world_size)
    if config.planning.calibration is not None:
        measured = read_calibration(config.planning.calibration)
        hardware, lines = calibrate(hardware, measured, precision=config.training.precision)
        print("\n".join(lines))
    chosen = []
    if config.training.global_batch_size is None:  # (the batch the run would take: a micro-batch per rank)
        batch = config.training.micro_batch_size * world_size
        config = override(config, global_batch_size=batch)
        chosen += [flag.global_batch_size, str(batch)]
    best = plan(config, world_size, hardware, top=1)[0]
    planned = override(config, **{name: best.settings[name] for name in LAYOUT_FIELDS}, auto=False)
    defaults = build_config({})
    for name in LAYOUT_FIELDS:
        info, value = all_fields()[name], best.settings[name]
        if value == getattr(getattr(defaults, info.section), name):
            continue
        if info.base_type is bool:
            chosen.append(info.flag if value else "--no-" + info.flag[2:])
        else:
            chosen += [info.flag, str(value)]
    return planned, [a for a in argv if a != flag.auto] + chosen, best
