"""`paratron doctor`: what this machine can do (versions, devices, interconnect, collective probes, warnings); the
flags, the launch and the report are `debugging.doctor`'s."""

from __future__ import annotations

from paratron.debugging.doctor import doctor_parser as parser
from paratron.debugging.doctor import run_doctor

__all__ = ["parser", "run"]


def run(argv: list[str]) -> int:
    """`paratron doctor ARGV`."""
    return run_doctor(argv)
