"""The ring of context-parallel ranks: each passes a tensor to the next and receives the
previous one's, without waiting, so the transfer overlaps the attention computed meanwhile."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratron.distributed.topology import RankGroup


class Ring:
    """Rank i of `group` sends to rank i + 1 and receives from rank i - 1 (cyclically)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        i, n = group.rank, group.size
        self.next, self.previous = group.ranks[(i + 1) % n], group.ranks[(i - 1) % n]

    def shift(self, tensor: torch.Tensor) -> PendingShift:
        """Start sending `tensor` to the next rank and receiving the previous rank's into a new
        buffer of the same shape; `wait()` on the result returns it."""
        tensor = tensor.contiguous()
        buffer = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group.process_group),
            dist.P2POp(dist.irecv, buffer, self.previous, self.group.process_group),
        ]
        return PendingShift(dist.batch_isend_irecv(ops), tensor, buffer)


class PendingShift:
    def __init__(self, works: list[dist.Work], sent: torch.Tensor, buffer: torch.Tensor) -> None:
        self.works, self.sent, self.buffer = works, sent, buffer  # (the sent tensor lives until it has left)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.buffer
