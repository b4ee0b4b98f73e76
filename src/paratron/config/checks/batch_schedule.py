"""Batches that change during a run (--rampup-batch-size, --step-batch-size-schedule): each one splits into
micro-batches on every data-parallel rank and is a count the pipeline schedule can run."""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.layout import Layout, check_schedule
from paratron.config.samples import batch_ramp, step_schedule
from paratron.config.schema import Config
from paratron.errors import ConfigError


def check_step_batch_schedule(config: Config, world_size: int) -> None:
    """--step-batch-size-schedule: well formed, not with --rampup-batch-size, ending at the global batch, and each
    batch one that every data-parallel rank splits into micro-batches (checked before the layout, which would name
    only --global-batch-size)."""
    t, p = config.training, config.parallel
    text = t.step_schedule_text()
    if text is None:
        return
    where = f"{flag.step_batch_size_schedule} {text!r}"
    if t.rampup_batch_size:
        raise ConfigError(f"{where} and {flag.rampup_batch_size} both change the batch size; give one")
    try:
        schedule = step_schedule(text, config.data.seq_length)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if t.global_batch_size is not None and schedule.global_batch_size != t.global_batch_size:
        raise ConfigError(
            f"{where} ends at a batch of {schedule.global_batch_size} but {flag.global_batch_size} is "
            f"{t.global_batch_size}; drop {flag.global_batch_size} or make it the schedule's last batch"
        )
    model_parallel = p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    if world_size % model_parallel:
        return  # (the layout names it)
    unit = t.micro_batch_size * world_size // model_parallel
    for batch in schedule.batch_sizes():
        if batch % unit:
            raise ConfigError(
                f"{where}: the batch of {batch} is not a multiple of {flag.micro_batch_size} x data-parallel size "
                f"({unit}); make every batch one"
            )


def check_rampup(config: Config, layout: Layout) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES: a ramp that reaches the global batch, in batches
    every data-parallel rank can split into micro-batches (and the pipeline schedule can run)."""
    t = config.training
    if not t.rampup_batch_size:
        return
    try:
        ramp_values = t.rampup()
    except ValueError:
        ramp_values = None
    where = f"{flag.rampup_batch_size} {' '.join(t.rampup_batch_size)}"
    if ramp_values is None:
        raise ConfigError(f"{where}: expected three integers START INCREMENT SAMPLES")
    ramp = batch_ramp(ramp_values, layout.global_batch_size)
    if ramp is None:
        raise ConfigError(
            f"{where}: START, INCREMENT and SAMPLES must be positive, START below "
            f"{flag.global_batch_size} {layout.global_batch_size}, and INCREMENT must step from START to it"
        )
    unit = layout.micro_batch_size * layout.dp
    if ramp.start % unit or ramp.increment % unit:
        raise ConfigError(
            f"{where}: START and INCREMENT must be multiples of {flag.micro_batch_size} x data-parallel size "
            f"({unit}) so that every batch of the ramp splits into micro-batches"
        )
    plan = layout.pipeline
    if plan.schedule is not None:
        for batch in range(ramp.start, layout.global_batch_size, ramp.increment):
            try:
                check_schedule(plan.schedule, layout.pp, batch // unit, plan.chunks)
            except ValueError as exc:
                raise ConfigError(f"{where}: the ramp's batch of {batch}: {exc}; change the ramp") from None


def check_step_batch_pipeline(config: Config, layout: Layout) -> None:
    """Each batch of --step-batch-size-schedule is a micro-batch count the pipeline schedule can run."""
    text, plan = config.training.step_schedule_text(), layout.pipeline
    if text is None or plan.schedule is None:
        return
    unit = layout.micro_batch_size * layout.dp
    for batch in step_schedule(text, config.data.seq_length).batch_sizes():
        try:
            check_schedule(plan.schedule, layout.pp, batch // unit, plan.chunks)
        except ValueError as exc:
            raise ConfigError(
                f"{flag.step_batch_size_schedule} {text!r}: the batch of {batch}: {exc}; change the schedule"
            ) from None
