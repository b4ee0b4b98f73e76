"""Learning-rate schedule values at known iterations."""

from __future__ import annotations

import math

import pytest

from paratron.config.schema import LRScheduleConfig
from paratron.optim.lr_schedule import learning_rate


def lr(it, style, warmup=10, decay=110, min_lr=0.1, max_lr=1.0, train_iters=200):
    schedule = LRScheduleConfig(lr_warmup_iters=warmup, lr_decay_iters=decay, lr_decay_style=style, min_lr=min_lr)
    return learning_rate(it, max_lr, schedule, train_iters)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_linear_warmup(style):
    assert lr(1, style) == pytest.approx(0.1)
    assert lr(5, style) == pytest.approx(0.5)
    assert lr(10, style) == pytest.approx(1.0)


def test_cosine_decay():
    assert lr(60, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway: 0.55
    assert lr(60, "cosine") == pytest.approx(0.55)
    assert lr(35, "cosine") == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.25)))
    assert lr(110, "cosine") == pytest.approx(0.1)
    assert lr(150, "cosine") == pytest.approx(0.1)  # stays at min after decay


def test_linear_and_constant_decay():
    assert lr(60, "linear") == pytest.approx(0.55)
    assert lr(85, "linear") == pytest.approx(1.0 - 0.9 * 0.75)
    assert lr(500, "linear") == pytest.approx(0.1)
    assert lr(60, "constant") == 1.0 and lr(500, "constant") == 1.0


def test_decay_defaults_to_train_iters_and_no_warmup():
    schedule = LRScheduleConfig(lr_decay_style="linear", min_lr=0.0)
    assert learning_rate(1, 2.0, schedule, train_iters=100) == pytest.approx(2.0 * 0.99)
    assert learning_rate(100, 2.0, schedule, train_iters=100) == pytest.approx(0.0)
