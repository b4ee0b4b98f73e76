"""The ring of context-parallel ranks: each passes a tensor to the next and receives the
previous one's, without waiting, so the transfer overlaps the attention computed meanwhile.

While `torch.compile` traces a block (`parallel/compile.py`) the shift is instead one functional
all-to-all that sends to the next rank only (`permute_tensor`), which dynamo keeps in the block's
graph: the asynchronous send/receive pairs have work handles a graph cannot hold. The compiler
may then schedule it against the attention; in eager the overlapped send/receive is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

from paratron.distributed.topology import RankGroup


class Ring:
    """Rank i of `group` sends to rank i + 1 and receives from rank i - 1 (cyclically)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        i, n = group.rank, group.size
        self.next, self.previous = group.ranks[(i + 1) % n], group.ranks[(i - 1) % n]
        self.destinations = [(j + 1) % n for j in range(n)]
        """Group rank j sends to destinations[j] (the functional form's description of the ring)."""

    def shift(self, tensor: torch.Tensor) -> PendingShift | ShiftedInGraph:
        """Start sending `tensor` to the next rank and receiving the previous rank's into a new
        buffer of the same shape; `wait()` on the result returns it."""
        if torch.compiler.is_compiling():
            flat = functional.permute_tensor(tensor.reshape(-1), self.destinations, self.group.process_group)
            return ShiftedInGraph(flat.view(tensor.shape))
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


class ShiftedInGraph:
    """A traced shift's result: the graph orders the wait, so there is nothing left to wait for."""

    def __init__(self, received: torch.Tensor) -> None:
        self.received = received

    def wait(self) -> torch.Tensor:
        return self.received
