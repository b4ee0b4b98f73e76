"""Launching, process groups, topology and seeding."""

from paratron.distributed.init import DistributedContext, initialize, launched_by_torchrun, seed_everything, shutdown
from paratron.distributed.topology import Axis, ParallelDims, RankGroup, Topology

__all__ = [
    "DistributedContext",
    "initialize",
    "launched_by_torchrun",
    "seed_everything",
    "shutdown",
    "Axis",
    "ParallelDims",
    "RankGroup",
    "Topology",
]
