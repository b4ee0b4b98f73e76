"""`paratron inspect CKPT [--diff CKPT2]`: what a checkpoint holds; the flags and the report are
`debugging.inspect`'s."""

from __future__ import annotations

from paratron.debugging.inspect import parser, run_inspect

__all__ = ["parser", "run"]


def run(argv: list[str]) -> int:
    """`paratron inspect ARGV`: exit 1 on a damaged file."""
    return run_inspect(argv)
