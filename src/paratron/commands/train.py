"""`paratron train`: a model trained from the flags and the recipe, launched under torchrun with --nproc N.

The checkpoint and training stacks (torch) are imported once the flags are read: `paratron train --help`
loads neither (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from paratron.commands.launching import check_and_launch, handed_over, quiet_launcher_logs
from paratron.config.arguments import ArgumentParser, add_config_arguments, given_settings, parse_config_arguments
from paratron.config.loading import Resolution, SavedModel, resolve_settings
from paratron.config.megatron import carry_on_like_megatron
from paratron.config.schema import MODEL_ARCHITECTURE, Config
from paratron.errors import ConfigError


def parser() -> argparse.ArgumentParser:
    """Every setting's flag (train's are the full set), with Megatron-LM's names."""
    parser = ArgumentParser(
        prog="paratron train",
        usage="paratron train [--config RECIPE] [--nproc N] [flags]",
        description="Train a GPT-family model. Settings come from defaults, then --model's registry entry, "
        "then the --config recipe, then flags; Megatron-LM flag names are accepted.",
        allow_abbrev=False,
    )
    add_config_arguments(parser)
    return parser


def train_config(argv: list[str]) -> Config:
    """The run's settings from `paratron train`'s flags (see `train_settings`)."""
    return train_settings(argv).config


def train_settings(argv: list[str]) -> Resolution:
    """The run's settings from `paratron train`'s flags, over the model of the checkpoint it loads, adjusted
    where Megatron-LM carries on, with where each came from."""
    recipe, overrides, namespace = parse_config_arguments(parser(), argv)
    given = given_settings(overrides, namespace)
    checkpoint_wins = "use_checkpoint_args" in given
    resolution = resolve_settings(
        overrides, recipe, checkpoint_wins=checkpoint_wins, read_checkpoint=_read_checkpoint, given=given
    )
    _quiet_a_launcher_of_nodes(resolution.config.parallel.nnodes)
    from paratron.checkpoint.verify import holds_checkpoint  # (start-up speed, docs/architecture.md: torch)

    if resolution.saved is not None:  # (its architecture came from the checkpoint, whatever the flags said)
        given -= set(MODEL_ARCHITECTURE)
    config, adjusted = carry_on_like_megatron(resolution.config, given, holds_checkpoint)
    _print_notes(resolution.notes, [*resolution.ignored.values(), *adjusted])
    return dataclasses.replace(resolution, config=config)


def _read_checkpoint(settings: Mapping[str, Any]) -> SavedModel | None:
    """What the checkpoint --load names says of its model (`checkpoint.model_of.read_saved_model`)."""
    _quiet_a_launcher_of_nodes(int(settings.get("nnodes") or 1))  # (before torch is imported, below)
    from paratron.checkpoint.model_of import read_saved_model  # (start-up speed, docs/architecture.md: torch)

    return read_saved_model(settings)


def _quiet_a_launcher_of_nodes(nnodes: int) -> None:
    """Before torch is imported: the launcher of a run over several nodes keeps torch's C++ log quiet."""
    if "RANK" not in os.environ and nnodes > 1:
        quiet_launcher_logs()


def _print_notes(notes: Sequence[str], warnings: Sequence[str]) -> None:
    """Once (by the launcher or rank 0): how the settings were resolved (`Resolution.notes`), then the warnings of
    the settings resolved as if not given (`Resolution.ignored`) and of what Megatron-LM adjusts."""
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)


def run(argv: list[str]) -> int:
    """`paratron train ARGV`: a dry run, or the run (with --auto, at the planner's layout) launched under
    torchrun or trained in this process (a worker, or the only process)."""
    handed = handed_over()
    if handed is not None:  # a worker its launcher started: the settings and layout the launcher checked
        from paratron.training.run import run_training  # (start-up speed, docs/architecture.md: torch)

        run_training(*handed)
        return 0
    settings = train_settings(argv)
    if settings.config.planning.dry_run:
        from paratron.planning.dry_run import run_dry_run  # (start-up speed, docs/architecture.md: torch)

        return run_dry_run(settings.config)
    if settings.config.planning.auto:
        argv, planned = _auto(settings.config, argv)
        settings = dataclasses.replace(settings, config=planned)
    config = settings.config
    launched, config, layout = check_and_launch(config, ["train", *argv], settings.origins)
    if launched is not None:
        return launched
    from paratron.training.run import run_training  # (start-up speed, docs/architecture.md: torch)

    run_training(config, layout)
    return 0


def _auto(config: Config, argv: list[str]) -> tuple[list[str], Config]:
    """--auto: the settings with the planner's top layout for this machine (resolved once: the layout's flags
    are added to the workers' command lines, which show it, and the settings themselves handed to them)."""
    from paratron.distributed.init import launched_by_torchrun  # (start-up speed, docs/architecture.md: torch)
    from paratron.planning.auto import auto_layout

    if launched_by_torchrun():
        raise ConfigError(
            "--auto plans before the workers start: launch with paratron train --nproc N --auto, or run "
            "`paratron plan` and start its command under torchrun"
        )
    world = config.planning.world_size or config.parallel.nproc_per_node * config.parallel.nnodes
    planned, argv, best = auto_layout(config, argv, world)
    print(
        f"--auto: {best.describe()}, predicted {best.prediction.tokens_per_s:,.0f} tokens/s, "
        f"peak {best.peak_memory / 1e9:.2f} GB per rank"
    )
    return argv, planned
