"""ZeRO stages 1 and 2: the parameters in one flat buffer laid out like the gradient buckets.

Each data-parallel rank's optimizer updates only its shard of every bucket (`optim/distributed.py`);
`start_gather` then brings every rank the new weights with one all-gather per bucket, in the
order forward needs them. With `overlap` the gathers run behind the next forward: the first
module that uses a bucket's parameters waits for that bucket (a forward pre-hook), so the
communication of the later buckets hides behind the compute of the earlier layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratron.distributed.topology import RankGroup
from paratron.parallel.data_parallel.buckets import GradientReducer


class FlatParameters:
    """The trained parameters of `module`, moved into one buffer (`buffer`) laid out like the
    gradients of `reducer`: each parameter's `.data` becomes its view of the buffer."""

    def __init__(self, module: nn.Module, reducer: GradientReducer, group: RankGroup, overlap: bool) -> None:
        self.reducer, self.group, self.overlap = reducer, group, overlap
        params = reducer.params
        self.buffer = torch.zeros(reducer.total, dtype=params[0].dtype, device=reducer.device)
        for p in params:
            view = reducer.view(self.buffer, p)
            view.copy_(p.data)
            p.data = view
        self._gathers: dict[int, Any] = {}
        if overlap:
            for sub in module.modules():
                mine = [p for p in sub.parameters(recurse=False) if id(p) in reducer.bucket_of]
                if mine:
                    buckets = sorted({reducer.bucket_of[id(p)].index for p in mine})
                    sub.register_forward_pre_hook(self._waiter(buckets))

    def start_gather(self) -> None:
        """Each rank has updated its shards of `buffer`; gather every bucket's parameters, in the
        order forward needs them, and wait at once unless `overlap`."""
        reducer = self.reducer
        if reducer.size == 1:
            return
        for bucket in reversed(reducer.buckets):
            lo, hi = bucket.shard(reducer.rank, reducer.size)
            self._gathers[bucket.index] = dist.all_gather_single(
                self.buffer[bucket.start : bucket.end],
                self.buffer[lo:hi],
                group=self.group.process_group,
                async_op=True,
            )
        if not self.overlap:
            self.wait()

    def wait(self, buckets: list[int] | None = None) -> None:
        """Wait for the gathers of `buckets` (default: all) still in flight."""
        for index in list(self._gathers) if buckets is None else buckets:
            work = self._gathers.pop(index, None)
            if work is not None:
                work.wait()

    def _waiter(self, buckets: list[int]):
        def hook(module: nn.Module, args: Any) -> None:
            if self._gathers:
                self.wait(buckets)

        return hook
