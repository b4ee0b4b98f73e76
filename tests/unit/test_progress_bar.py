"""--progress-bar: unset, the bar shows only when rank 0 writes to a terminal, so that log files
(Slurm, nohup, a redirect) get the periodic log lines without a bar redrawn into them."""

from __future__ import annotations

import io
import sys

import pytest

from paratron.commands.train import parser as train_parser
from paratron.config.arguments import parse_config_arguments
from paratron.config.loading import build_config
from paratron.training.metrics import MetricsWriter, wants_progress_bar

RECORD = {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "tflops_per_device": 0.1,
          "mfu": 0.01, "mem_gb": 0.2}  # fmt: skip


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_unset_follows_the_streams_and_the_flag_wins():
    tty, log = Terminal(), io.StringIO()
    assert wants_progress_bar(None, tty, tty)
    assert not wants_progress_bar(None, log, tty) and not wants_progress_bar(None, tty, log)
    assert wants_progress_bar(True, log, log) and not wants_progress_bar(False, tty, tty)


@pytest.mark.parametrize("argv, setting", [([], None), (["--progress-bar"], True), (["--no-progress-bar"], False)])
def test_the_flag_is_three_way(argv, setting):
    recipe, overrides, _ = parse_config_arguments(train_parser(), argv)
    assert build_config(overrides, recipe).logging.progress_bar is setting


@pytest.mark.parametrize("terminal", [True, False])
def test_the_writer_draws_only_on_a_terminal_and_logs_either_way(tmp_path, monkeypatch, terminal):
    out, err = (Terminal(), Terminal()) if terminal else (io.StringIO(), io.StringIO())
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with MetricsWriter(tmp_path, 5, 0, enabled=True, progress_bar=None, tensorboard=False) as writer:
        writer.advance()
        writer.log_step(RECORD)
        assert (writer.bar is not None) is terminal
    assert ("train:" in err.getvalue()) is terminal  # the bar's own stream
    assert "step 1/5 | loss 2.5000" in out.getvalue()  # the log line, either way
