"""The learning-rate schedule and the batch ramp against megatron-core's own scheduler and
micro-batch calculator, step by step, and in a tiny real run (decoupled groups, ramp)."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest

from paratron.config import build_config
from paratron.config.samples import BatchRamp, batch_ramp
from paratron.config.validation import validate
from paratron.errors import ConfigError
from paratron.optim.lr_schedule import LRSchedule
from paratron.training import loop
from paratron.training.run import run_training

from tiny import tiny_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.num_microbatches_calculator import (
        ConstantNumMicroBatchesCalculator,
        RampupBatchsizeNumMicroBatchesCalculator,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

BASE = dict(lr_warmup_iters=0, lr_decay_style="linear", min_lr=0.0)
"""The debug recipe sets a 5-step warmup, cosine decay and a floor: back to Megatron-LM's defaults."""


def megatron_steps(flags: dict, mbs: int = 1, dp: int = 1):
    """Megatron-LM's run of `flags` (field names): yields (step's batch, main lr, decoupled lr) of
    every step, driving megatron-core's scheduler as `megatron/training/training.py` does
    (`get_optimizer_param_scheduler`, `update_train_iters`, `step(increment=...)` after each step)."""
    a = SimpleNamespace(**{**_defaults(), **flags})
    gbs = a.global_batch_size
    if a.rampup_batch_size:
        calc = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 1, *map(int, a.rampup_batch_size))
    else:
        calc = ConstantNumMicroBatchesCalculator(gbs, mbs, dp, False, 1)
    if a.train_samples is None:  # iteration-based
        decay = (a.lr_decay_iters or a.train_iters) * gbs
        wsd = a.lr_wsd_decay_iters * gbs if a.lr_wsd_decay_iters is not None else None
        warmup = a.lr_warmup_fraction * decay if a.lr_warmup_fraction is not None else a.lr_warmup_iters * gbs
        iters = a.train_iters
    else:
        iters, consumed = 0, 0
        if a.rampup_batch_size:  # update_train_iters
            while consumed <= int(a.rampup_batch_size[2]) and consumed <= a.train_samples:
                calc.update(consumed, False)
                consumed += calc.get_current_global_batch_size()
                iters += 1
            calc.update(0, False)
        if a.train_samples > consumed:
            iters += (a.train_samples - consumed) // gbs
        decay = a.lr_decay_samples or a.train_samples
        wsd = a.lr_wsd_decay_samples
        warmup = a.lr_warmup_fraction * decay if a.lr_warmup_fraction is not None else a.lr_warmup_samples
    groups = [{"max_lr": a.lr, "min_lr": a.min_lr, "wd_mult": 1.0}]
    if a.decoupled_lr is not None:
        groups.append({"max_lr": a.decoupled_lr, "min_lr": a.decoupled_min_lr or a.min_lr, "wd_mult": 1.0})
    optimizer = SimpleNamespace(param_groups=groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler = OptimizerParamScheduler(
            optimizer, a.lr_warmup_init, a.lr, a.min_lr, warmup, decay, a.lr_decay_style, 0.1, 0.1, decay,
            "constant", wsd_decay_steps=wsd, lr_wsd_decay_style=a.lr_wsd_decay_style,
        )  # fmt: skip
    consumed = 0
    for _ in range(iters):
        calc.update(consumed, True)
        batch = calc.get() * mbs * dp
        yield batch, groups[0]["lr"], groups[-1]["lr"]
        scheduler.step(increment=batch)
        consumed += batch


def _defaults() -> dict:
    return dict(
        lr=1.0, min_lr=0.0, lr_warmup_init=0.0, lr_warmup_iters=0, lr_warmup_samples=0, lr_warmup_fraction=None,
        lr_decay_iters=None, lr_decay_samples=None, lr_decay_style="linear", lr_wsd_decay_style="exponential",
        lr_wsd_decay_iters=None, lr_wsd_decay_samples=None, train_iters=None, train_samples=None,
        global_batch_size=1, rampup_batch_size=None, decoupled_lr=None, decoupled_min_lr=None,
    )  # fmt: skip


def paratron_steps(flags: dict, mbs: int = 1, dp: int = 1):
    """paratron's: the schedule and ramp the training loop uses, stepped as `Trainer._train` steps them."""
    config = build_config({**BASE, "micro_batch_size": mbs, **flags}, recipe="debug")
    gbs = config.training.global_batch_size
    schedule = LRSchedule.of(config, gbs)
    ramp = batch_ramp(config.training.rampup(), gbs)
    groups = [{}, {"max_lr": flags.get("decoupled_lr")}]
    if flags.get("decoupled_min_lr") is not None:
        groups[1]["min_lr"] = flags["decoupled_min_lr"]
    consumed = lr_samples = 0
    for _ in range(config.training.train_iters):
        lr = schedule.apply(groups, lr_samples)
        batch = ramp.batch_at(consumed) if ramp else gbs
        yield batch, lr, groups[1]["lr"] if flags.get("decoupled_lr") is not None else lr
        consumed += batch
        lr_samples += batch


CASES = {
    "linear, warmup iters": dict(train_iters=40, lr_warmup_iters=7, global_batch_size=4, min_lr=0.1),
    "cosine, decay iters, warmup init": dict(
        train_iters=50, lr_warmup_iters=5, lr_decay_iters=40, lr_decay_style="cosine", lr_warmup_init=0.05, min_lr=0.01
    ),
    "constant": dict(train_iters=20, lr_warmup_iters=3, lr_decay_style="constant", global_batch_size=2),
    "inverse-square-root": dict(
        train_iters=30, lr_warmup_iters=4, lr_decay_style="inverse-square-root", min_lr=0.2, global_batch_size=3
    ),
    "WSD exponential (iters)": dict(
        train_iters=40, lr_warmup_iters=4, lr_decay_style="WSD", lr_wsd_decay_iters=10, min_lr=0.05
    ),
    "warmup fraction (iters)": dict(train_iters=33, lr_warmup_fraction=0.15, global_batch_size=8, min_lr=0.01),
    "decoupled lr and min lr": dict(
        train_iters=25, lr_warmup_iters=5, lr_decay_style="cosine", min_lr=0.1, decoupled_lr=3.0, decoupled_min_lr=0.3,
        global_batch_size=4,
    ),
    "decoupled lr, schedule's min lr": dict(train_iters=15, lr_warmup_iters=2, min_lr=0.1, decoupled_lr=0.5),
    "samples: linear": dict(train_samples=101, global_batch_size=4, lr_warmup_samples=10, min_lr=0.1),
    "samples: cosine, decay samples": dict(
        train_samples=120, global_batch_size=6, lr_warmup_samples=13, lr_decay_samples=90, lr_decay_style="cosine"
    ),
    "samples: warmup fraction, WSD minus_sqrt": dict(
        train_samples=200, global_batch_size=8, lr_warmup_fraction=0.1, lr_decay_style="WSD",
        lr_wsd_decay_samples=64, lr_wsd_decay_style="minus_sqrt", min_lr=0.02,
    ),
    "samples: WSD cosine and linear": dict(
        train_samples=160, global_batch_size=8, lr_warmup_samples=16, lr_decay_style="WSD",
        lr_wsd_decay_samples=40, lr_wsd_decay_style="cosine",
    ),
    "samples: WSD linear, decay samples": dict(
        train_samples=130, global_batch_size=4, lr_decay_samples=100, lr_decay_style="WSD",
        lr_wsd_decay_samples=30, lr_wsd_decay_style="linear", min_lr=0.1,
    ),
    "samples: inverse-square-root": dict(
        train_samples=150, global_batch_size=5, lr_warmup_samples=20, lr_decay_style="inverse-square-root"
    ),
    "rampup": dict(
        train_samples=300, global_batch_size=16, rampup_batch_size=["4", "4", "100"], lr_warmup_samples=30,
        lr_decay_style="cosine", min_lr=0.1, decoupled_lr=2.0,
    ),
    "rampup, ramp longer than the run": dict(
        train_samples=90, global_batch_size=32, rampup_batch_size=["8", "8", "1000"], lr_warmup_fraction=0.2
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_every_step_matches_megatron_core(name):
    flags = {**CASES[name], "lr": 1.0}
    flags.setdefault("global_batch_size", 1)
    ours, theirs = list(paratron_steps(flags)), list(megatron_steps(flags))
    assert len(ours) == len(theirs) > 10
    for step, ((b, lr, dec), (mb, mlr, mdec)) in enumerate(zip(ours, theirs), 1):
        assert b == mb, f"step {step}: batch {b} vs Megatron-LM's {mb}"
        assert lr == pytest.approx(mlr, rel=1e-12, abs=1e-15), f"step {step}: lr {lr} vs {mlr}"
        assert dec == pytest.approx(mdec, rel=1e-12, abs=1e-15), f"step {step}: decoupled lr {dec} vs {mdec}"
    if flags.get("lr_warmup_iters") or flags.get("lr_warmup_samples") or flags.get("lr_warmup_fraction"):
        assert ours[0][1] == flags.get("lr_warmup_init", 0.0)  # the first step runs at the warmup's start


def test_ramp_matches_megatron_core_calculator():
    for start, increment, samples, gbs in [(4, 4, 100, 16), (8, 8, 1000, 32), (2, 6, 7, 20), (3, 1, 1, 5)]:
        ours = BatchRamp(start, increment, samples, gbs)
        theirs = RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, 1, start, increment, samples)
        for consumed in range(0, samples + 3 * gbs):
            theirs.update(consumed, False)
            assert ours.batch_at(consumed) == theirs.get_current_global_batch_size(), (start, consumed)


def test_decoupled_groups_and_ramp_in_a_real_run(tmp_path, monkeypatch):
    """A tiny run with --decoupled-lr and --rampup-batch-size: each step's groups carry the
    scheduled rates (embedding and output weights the decoupled one), and the steps consume the
    ramp's batches."""
    seen = []
    apply = loop.LRSchedule.apply

    def recording(self, groups, samples):
        lr = apply(self, groups, samples)
        seen.append([(g["lr"], sorted(tuple(p.shape) for p in g["params"])) for g in groups])
        return lr

    monkeypatch.setattr(loop.LRSchedule, "apply", recording)
    flags = dict(
        BASE, train_samples=40, global_batch_size=8, rampup_batch_size=["2", "2", "12"], lr_warmup_samples=6,
        lr=1e-2, min_lr=1e-3, decoupled_lr=5e-2, decoupled_min_lr=2e-3, lr_decay_style="cosine",
        untie_embeddings_and_output_weights=True,
    )  # fmt: skip
    config = tiny_config(tmp_path, micro_batch_size=2, **flags)
    validate(config, 1)
    run_training(config)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    expected = list(megatron_steps({**_defaults(), **{k: v for k, v in flags.items() if k in _defaults()}}, mbs=2))
    assert [r["consumed_samples"] for r in records] == [2, 4, 8, 14, 22, 30, 38]
    assert len(seen) == len(records) == len(expected)
    vocab, hidden = config.model.vocab_size, config.model.hidden_size

    def embedding_or_output(shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and shape[1] == hidden and shape[0] >= vocab

    for record, groups, (_, lr, decoupled) in zip(records, seen, expected):
        assert record["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-15)
        for group_lr, shapes in groups:
            if shapes and all(embedding_or_output(s) for s in shapes):
                assert group_lr == pytest.approx(decoupled, rel=1e-12, abs=1e-15)
            else:
                assert not any(embedding_or_output(s) for s in shapes)
                assert group_lr == pytest.approx(lr, rel=1e-12, abs=1e-15)
    assert sum(embedding_or_output(s) for _, shapes in seen[0] for s in shapes) == 2  # embedding, untied output
    assert seen[1][0][0] != seen[1][-1][0]  # (the decoupled rate differs from the main one)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(train_samples=64, global_batch_size=8, lr_warmup_iters=2), "--lr-warmup-iters counts iterations"),
        (dict(train_samples=64, global_batch_size=8, lr_decay_iters=5), "use --lr-decay-samples"),
        (dict(lr_warmup_samples=16), "--lr-warmup-samples is for sample-based runs"),
        (dict(train_samples=64), "--train-samples needs --global-batch-size"),
        (dict(lr_warmup_fraction=0.1, lr_warmup_iters=3), "give one"),
        (dict(lr_decay_style="WSD"), "--lr-wsd-decay-iters"),
        (dict(train_iters=10, lr_warmup_iters=10), "not shorter than the decay"),
        (dict(lr_warmup_init=1.0, lr=0.1), "--lr-warmup-init 1.0 exceeds --lr"),
        (dict(use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=True), "contradict"),
        (
            dict(train_samples=64, global_batch_size=32, rampup_batch_size=["5", "3", "16"]),
            "multiples of --micro-batch-size",
        ),
        (dict(train_samples=64, global_batch_size=32, rampup_batch_size=["8", "5", "16"]), "INCREMENT must step"),
        (dict(train_samples=64, global_batch_size=32, rampup_batch_size=["8", "8"]), "three integers"),
    ],
)
def test_megatron_refusals(flags, message):
    config = build_config({**BASE, "micro_batch_size": 2, **flags}, recipe="debug")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(config, 1, check_data=False)


def test_sample_based_run_derives_its_steps():
    config = build_config(dict(BASE, train_samples=100, global_batch_size=8), recipe="debug")
    assert config.training.train_iters == 12  # the partial last batch is dropped
    validate(config, 1, check_data=False)
