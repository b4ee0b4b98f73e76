"""Data parallelism and the distributed optimizer: bucketed, overlapped gradient reduction
(`buckets`, `ddp`), ZeRO stages 1 and 2 (`zero`) and stage 3 over FSDP2 (`fully_sharded`)."""

from paratron.parallel.data.ddp import DataParallel, DataParallelSettings, unwrap

__all__ = ["DataParallel", "DataParallelSettings", "unwrap"]
