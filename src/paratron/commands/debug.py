"""`paratron debug compare`: two layouts trained side by side and compared step by step; the flags, the runs and
the report are `debugging.compare`'s."""

from __future__ import annotations

from paratron.debugging.compare import run_debug


def run(argv: list[str]) -> int:
    """`paratron debug ARGV`: exit 1 when the two runs part."""
    return run_debug(argv)
