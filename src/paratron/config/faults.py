"""The format of --fault-inject: RANK:STEP:KIND (the faults themselves: training/faults.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from paratron.config.fields import flag
from paratron.errors import ConfigError

KINDS = ("crash", "hang", "nan", "slow", "spike")
_SPEC = re.compile(r"^(\d+):(\d+):(\w+)$")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str


def parse_faults(specs: list[str], world_size: int | None = None) -> list[Fault]:
    """The faults of --fault-inject, in order; ConfigError (one line) for a malformed one or a rank
    outside the world."""
    faults = []
    for spec in specs:
        match = _SPEC.match(spec)
        if match is None or match.group(3) not in KINDS or int(match.group(2)) < 1:
            raise ConfigError(
                f"{flag.fault_inject} {spec}: expected RANK:STEP:KIND with STEP from 1 and KIND one of "
                f"{', '.join(KINDS)} (e.g. 1:5:crash)"
            )
        fault = Fault(int(match.group(1)), int(match.group(2)), match.group(3))
        if world_size is not None and fault.rank >= world_size:
            raise ConfigError(f"{flag.fault_inject} {spec}: rank {fault.rank} is outside the {world_size} ranks")
        faults.append(fault)
    return faults
