"""Point-to-point traffic between pipeline stages: activations forward, gradients backward.

Sends are posted without waiting, together with the receive the next operation needs, as
one `batch_isend_irecv` per process group, as soon as the current operation has produced
them; the receive is posted then too, so its transfer overlaps the current work (NCCL runs a batch as one group, so two
neighbours that each send to and receive from the other cannot block each other). A receive is waited for only when
its tensor is needed. Activations and gradients travel in separate process groups, so the
messages of each kind between two ranks arrive in the order they were sent, whatever the
schedule interleaves (with two ranks and virtual stages both kinds flow both ways).

Shapes are known ahead (micro-batch x sequence (shard) x hidden, `message_shape`); with
variable sequence lengths each message is preceded by its shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratron.distributed.topology import RankGroup

ACTIVATION, GRADIENT = "activation", "gradient"
_HEADER = 9  # a shape message: number of dimensions (at most 8), then the sizes


class StageComm:
    """Messages between this rank's pipeline stages and their neighbours. `groups` holds a group
    over this rank's pipeline ranks for each kind of message; `hidden_size` and `sequence_divisor`
    (the tensor-parallel size under sequence parallelism) give the messages' shape."""

    def __init__(
        self,
        groups: dict[str, RankGroup],
        dtype: torch.dtype,
        device: torch.device,
        hidden_size: int,
        sequence_divisor: int = 1,
        variable_shapes: bool = False,
    ) -> None:
        self.ranks = list(groups[ACTIVATION].ranks)  # global rank of every pipeline rank
        self.groups = {kind: group.process_group for kind, group in groups.items()}
        self.dtype, self.device = dtype, device
        self.hidden_size, self.sequence_divisor = hidden_size, sequence_divisor
        self.variable_shapes = variable_shapes
        self._queued: list[dist.P2POp] = []
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    def message_shape(self, tokens: torch.Tensor) -> tuple[int, ...]:
        """The shape of the activations (and their gradients) of micro-batch `tokens`."""
        batch, length = tokens.shape
        return (batch, length // self.sequence_divisor, self.hidden_size)

    def send(self, tensor: torch.Tensor, peer: int, kind: str) -> None:
        """Queue `tensor` for `peer` (a global rank); it leaves with the next exchange."""
        tensor = tensor.detach().contiguous()
        if self.variable_shapes:
            shape = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            shape[: 1 + tensor.dim()] = torch.tensor([tensor.dim(), *tensor.shape])
            self._queued.append(dist.P2POp(dist.isend, shape, peer, self.groups[kind]))
        self._queued.append(dist.P2POp(dist.isend, tensor, peer, self.groups[kind]))

    def post_receive(self, shape: tuple[int, ...], peer: int, kind: str) -> PendingReceive:
        """Post the queued sends and a receive without waiting for it, so the transfer overlaps
        whatever this rank computes before it needs the tensor. (With variable shapes the shape
        message is waited for first.)"""
        if self.variable_shapes:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self._exchange(dist.P2POp(dist.irecv, header, peer, self.groups[kind])).wait()
            shape = tuple(int(v) for v in header[1 : 1 + int(header[0])])
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        return PendingReceive(self._exchange(dist.P2POp(dist.irecv, buffer, peer, self.groups[kind])), buffer)

    def flush(self) -> None:
        """Post the queued sends now (nothing to receive before the next computation)."""
        if self._queued:
            self._exchange(None)

    def wait_sends(self) -> None:
        """Wait until every posted send has left (end of a step)."""
        self.flush()
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()

    def _exchange(self, receive: dist.P2POp | None) -> dist.Work:
        """Post the queued sends and `receive`; ops of one group go as one batch (batches cannot
        mix groups; each group has its own communicator, so separate batches cannot block each other)."""
        ops = self._queued + ([receive] if receive is not None else [])
        self._queued = []
        batches: dict[int, list[dist.P2POp]] = {}
        for op in ops:
            batches.setdefault(id(op.group), []).append(op)
        last: dist.Work | None = None
        for batch in batches.values():
            works = dist.batch_isend_irecv(batch)
            # keep each sent tensor alive until its send completes
            self._in_flight += [(w, op.tensor) for w, op in zip(works, batch) if op is not receive]
            last = works[-1]
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
        assert last is not None
        return last


class PendingReceive:
    def __init__(self, work: dist.Work, buffer: torch.Tensor) -> None:
        self.work, self.buffer = work, buffer

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer
