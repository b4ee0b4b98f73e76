"""Launching, process groups, topology and seeding.

Names are imported on first use, so that `paratron.distributed.parent`, which a worker runs
before anything slow, does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DistributedContext": "paratron.distributed.init",
    "initialize": "paratron.distributed.init",
    "launched_by_torchrun": "paratron.distributed.init",
    "seed_everything": "paratron.distributed.init",
    "shutdown": "paratron.distributed.init",
    "Axis": "paratron.distributed.topology",
    "ParallelDims": "paratron.distributed.topology",
    "RankGroup": "paratron.distributed.topology",
    "Topology": "paratron.distributed.topology",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'paratron.distributed' has no attribute {name!r}")
