"""Token dispatchers: run a MoE layer's experts when each of the EP ranks of the expert-parallel
group holds E / EP of them (rank r experts [r E/EP, (r+1) E/EP)). Both take this rank's tokens
and routing and return, for each token, the sum of its experts' weighted outputs, as
`model.moe.run_experts` does on one device, with the same summation order per token.

alltoall (Megatron's default): each routed copy of a token travels to the rank of its expert
    and back: two all-to-alls with uneven splits (tokens and their probs there, outputs back),
    after one small all-to-all of the counts. Sent per layer and micro-batch: the routed copies
    bound for other ranks, N k (EP - 1) / EP rows of H on average, there and back.
allgather: every rank gathers all ranks' tokens and routing, runs its experts on the copies
    routed to them, and the outputs are reduce-scattered back (N (EP - 1) rows of H each way,
    whatever k): simpler, and cheaper when k is large next to EP.
"""

from __future__ import annotations

import torch

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.model.moe import Experts, run_experts, sort_by_expert, sum_by_token
from paratron.parallel.expert.comm import all_to_all, exchange


class Dispatcher:
    """Runs the local experts of an expert-parallel group."""

    def __init__(self, group: RankGroup, num_experts: int) -> None:
        self.group = group
        self.num_experts = num_experts
        self.local_experts = num_experts // group.size
        self.first_expert = group.rank * self.local_experts

    def __call__(
        self,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        experts: Experts,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        """tokens [n, H], probs and routing map [n, E] -> [n, H]; `pad_to`: the capacity of an
        expert for this rank's tokens (each local expert is padded to it times EP)."""
        raise NotImplementedError


class AllToAllDispatcher(Dispatcher):
    def __call__(self, tokens, probs, routing_map, experts, pad_to=None):
        group, ep, local = self.group, self.group.size, self.local_experts
        if ep == 1:
            return run_experts(tokens, probs, routing_map, experts, pad_to)
        copies, copy_probs, counts, token = sort_by_expert(tokens, probs, routing_map)
        # what each rank sends to each rank, per local expert of the receiver: [EP sources, local]
        received = exchange(counts, [local] * ep, [local] * ep, group).view(ep, local)
        input_splits = counts.view(ep, local).sum(dim=1).tolist()
        output_splits = received.sum(dim=1).tolist()
        x = all_to_all(copies, output_splits, input_splits, group)
        p = all_to_all(copy_probs, output_splits, input_splits, group)
        order = _expert_major(received)  # arrived by source rank, then expert: group them by expert
        pad = pad_to * ep if pad_to is not None else None
        y = experts(x[order], received.sum(dim=0).tolist(), p[order], pad)
        back = all_to_all(y[torch.argsort(order)], input_splits, output_splits, group)
        return sum_by_token(back, token, tokens)


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Rows arrive in blocks (source s, expert e) of counts[s, e] rows, s-major; the permutation
    that puts them e-major (each expert's rows together, by source within)."""
    sources, local = counts.shape
    starts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(sources, local)
    lengths = counts.t().reshape(-1)
    block_starts = starts.t().reshape(-1)
    first_row = torch.repeat_interleave(block_starts - (torch.cumsum(lengths, 0) - lengths), lengths)
    return first_row + torch.arange(int(lengths.sum()), device=counts.device)


class AllGatherDispatcher(Dispatcher):
    def __call__(self, tokens, probs, routing_map, experts, pad_to=None):
        group, ep = self.group, self.group.size
        if ep == 1:
            return run_experts(tokens, probs, routing_map, experts, pad_to)
        mine = slice(self.first_expert, self.first_expert + self.local_experts)
        # (whole rows are gathered: the gradient's reduce-scatter adds the same columns from every rank)
        every_token = comm.gather_from_sequence(tokens, group, dim=0)
        every_prob = comm.gather_from_sequence(probs, group, dim=0)[:, mine]
        every_map = comm.all_gather(routing_map.to(torch.uint8), 0, group).bool()[:, mine]
        pad = pad_to * ep if pad_to is not None else None
        partial = run_experts(every_token, every_prob, every_map, experts, pad)
        return comm.reduce_scatter_to_sequence(partial, group, dim=0)


DISPATCHERS: dict[str, type[Dispatcher]] = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
"""--moe-token-dispatcher-type -> its class."""
