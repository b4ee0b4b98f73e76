"""Data parallelism and the distributed optimizer's storage: bucketed, overlapped gradient
reduction (`buckets`, `ddp`), the flat parameter buffer of ZeRO stages 1 and 2
(`param_gather`) and stage 3 over FSDP2 (`fully_sharded`)."""

from paratron.parallel.data_parallel.ddp import DataParallelGradients, DataParallelSettings
from paratron.parallel.data_parallel.param_gather import FlatParameters

__all__ = ["DataParallelGradients", "DataParallelSettings", "FlatParameters"]
