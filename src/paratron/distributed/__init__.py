"""Launching, process groups, topology and seeding."""

from paratron.distributed.init import DistributedContext, initialize, launched_by_torchrun, seed_everything, shutdown
from paratron.distributed.topology import ParallelDims, Topology

__all__ = ["DistributedContext", "initialize", "launched_by_torchrun", "seed_everything", "shutdown",
           "ParallelDims", "Topology"]
