"""The learning-rate schedule, and Megatron-LM's rules for iteration- and sample-based runs."""

from __future__ import annotations

from paratron.config.checks.batch_schedule import check_rampup, check_step_batch_pipeline
from paratron.config.fields import flag
from paratron.config.layout import Layout
from paratron.config.samples import schedule_lengths
from paratron.config.schema import Config
from paratron.errors import ConfigError


def check_lr_schedule(config: Config) -> None:
    """The warmup fits in the decay, and the floor of the learning rate is below its peak."""
    s, o, t = config.lr_schedule, config.optimizer, config.training
    decay_iters = s.lr_decay_iters or t.train_iters
    if s.lr_warmup_iters > decay_iters:
        raise ConfigError(
            f"{flag.lr_warmup_iters} {s.lr_warmup_iters} exceeds the decay length {decay_iters}; "
            f"lower it or raise {flag.lr_decay_iters}"
        )
    if s.min_lr > o.lr:
        raise ConfigError(f"{flag.min_lr} {s.min_lr} exceeds {flag.lr} {o.lr}; lower {flag.min_lr}")


def check_sample_based(config: Config, layout: Layout) -> None:
    """Megatron-LM's rules for iteration- and sample-based runs (never mixed), the batch ramp, and
    what its learning-rate scheduler asserts. One exception: a batch ramp with --train-iters, which
    Megatron-LM refuses although its own GPT-3 example asks for it, runs (the ramp and the schedule
    count consumed samples either way)."""
    s, t, o = config.lr_schedule, config.training, config.optimizer
    by_samples = {
        flag.lr_decay_samples: s.lr_decay_samples is not None,
        flag.lr_warmup_samples: s.lr_warmup_samples != 0,
        flag.lr_wsd_decay_samples: s.lr_wsd_decay_samples is not None,
    }
    by_iters = {
        flag.lr_decay_iters: (s.lr_decay_iters is not None, flag.lr_decay_samples),
        flag.lr_warmup_iters: (s.lr_warmup_iters != 0, flag.lr_warmup_samples),
        flag.lr_wsd_decay_iters: (s.lr_wsd_decay_iters is not None, flag.lr_wsd_decay_samples),
    }
    if t.train_samples is None:
        for name, given in by_samples.items():
            if given:
                raise ConfigError(f"{name} is for sample-based runs: give {flag.train_samples} instead of iterations")
    else:
        for name, (given, instead) in by_iters.items():
            if given:
                raise ConfigError(f"{name} counts iterations but {flag.train_samples} is set; use {instead}")
        if t.global_batch_size is None:
            raise ConfigError(f"{flag.train_samples} needs {flag.global_batch_size} (the samples of one full step)")
        if t.train_iters < 1:
            raise ConfigError(
                f"{flag.train_samples} {t.train_samples} is less than one step of {flag.global_batch_size} "
                f"{t.global_batch_size}; raise it"
            )
    if s.lr_warmup_fraction is not None and (s.lr_warmup_iters or s.lr_warmup_samples):
        which = flag.lr_warmup_iters if s.lr_warmup_iters else flag.lr_warmup_samples
        raise ConfigError(f"{flag.lr_warmup_fraction} and {which} both set the warmup; give one")
    check_rampup(config, layout)
    check_step_batch_pipeline(config, layout)
    lengths = schedule_lengths(s, t, layout.global_batch_size)
    if lengths.decay <= 0:
        raise ConfigError(f"the learning-rate decay is {lengths.decay} samples long; it must be positive")
    if lengths.warmup >= lengths.decay:
        raise ConfigError(
            f"the warmup ({lengths.warmup:g} samples) is not shorter than the decay ({lengths.decay} samples); "
            "shorten the warmup or lengthen the decay"
        )
    if s.lr_decay_style == "WSD" and lengths.wsd_decay is None:
        which = flag.lr_wsd_decay_samples if t.train_samples is not None else flag.lr_wsd_decay_iters
        raise ConfigError(f"{flag.lr_decay_style} WSD needs {which} (the length of the final annealing)")
    if s.lr_warmup_init > o.lr:
        raise ConfigError(f"{flag.lr_warmup_init} {s.lr_warmup_init} exceeds {flag.lr} {o.lr}; lower it")
    if s.min_lr < 0:
        raise ConfigError(f"{flag.min_lr} {s.min_lr} is negative; use 0 or more")
    if s.use_checkpoint_opt_param_scheduler and s.override_opt_param_scheduler:
        raise ConfigError(
            f"{flag.use_checkpoint_opt_param_scheduler} and {flag.override_opt_param_scheduler} contradict; give one"
        )
