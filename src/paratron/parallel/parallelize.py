"""The one ordered transform from a plain single-device model to this rank's parallel model.

Order (as in torchtitan): tensor/sequence parallelism -> activation recomputation ->
pipeline stage split -> data parallelism. Today only data parallelism is applied;
`config.validation` refuses the other degrees above 1 until they are.
"""

from __future__ import annotations

from torch import nn

from paratron.config.schema import Config
from paratron.distributed.topology import Topology
from paratron.parallel.data import DataParallel


def parallelize(model: nn.Module, config: Config, topology: Topology) -> DataParallel:
    """Return `model` wrapped for this rank's place in `topology`."""
    return DataParallel(model, topology.group("dp"), topology.size("dp"))
