"""One-line errors name the flags the user typed and a fix that works: another spelling of a setting's flag
(`--nproc` for `--nproc-per-node`) is answered in that spelling."""

from __future__ import annotations

import pytest

from paratron.cli import main
from paratron.config.arguments import as_typed


@pytest.mark.parametrize(
    "typed, said",
    [
        (["--nproc", "0"], "error: --nproc 0: must be at least 1"),
        (["--nproc=0"], "error: --nproc 0: must be at least 1"),
        (["--nproc-per-node", "0"], "error: --nproc-per-node 0: must be at least 1"),
    ],
)
def test_a_flag_is_named_as_typed(capsys, typed, said):
    assert main(["train", "--config", "debug", *typed]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [said]


def test_only_whole_flags_are_respelled():
    message = "--nproc-per-node 3 exceeds the 2 GPUs; use --nproc-per-node 2 (--nproc-per-nodes is no flag)"
    assert (
        as_typed(message, ["--nproc", "3"])
        == "--nproc 3 exceeds the 2 GPUs; use --nproc 2 (--nproc-per-nodes is no flag)"
    )
    assert as_typed(message, ["--nproc", "3", "--nproc-per-node", "3"]) == message
    assert (
        as_typed("argument --nproc-per-node/--nproc: expected an integer", ["--nproc", "x"]).count("--nproc-per-node")
        == 1
    )
