"""A world of ranks that exist only in name: torch.distributed's fake process group.

`paratron train --dry-run` builds one rank's part of the model for a world of thousands of
ranks in this process. The fake backend answers every collective at once without moving data,
so the real code paths (the topology's groups, tensor parallelism's layers, the gradient
buckets, FSDP2's sharding) run unchanged on meta tensors. torchtitan's dry runs use the same
backend; it registers itself when its module is imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from paratron.errors import ConfigError


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """Within: this process is `rank` of `world_size` ranks that exchange nothing."""
    if dist.is_initialized():
        raise ConfigError("--dry-run builds its own fake world of ranks; run it without torchrun or --nproc")
    excepthook = sys.excepthook  # (joining a world wraps it to prefix tracebacks with the rank)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
