"""A MoE router under context parallelism: each rank routes its chunks of every sequence, and the
load-balancing losses count the chosen experts over the whole sequence (one all-reduce of the
counts over the context-parallel group), so their sum over the ranks is the single-device loss."""

from __future__ import annotations

import torch

from paratron.distributed import comm
from paratron.distributed.topology import RankGroup
from paratron.model.moe import Router


class ContextParallelRouter(Router):
    """`Router` whose sequences are split over `group`: the same parameters, statistics over every part."""

    group: RankGroup

    @classmethod
    def twin(cls, router: Router, group: RankGroup) -> ContextParallelRouter:
        twin = cls.__new__(cls)
        twin.__dict__.update(router.__dict__)
        twin.group, twin.sequence_parts = group, group.size
        return twin

    def whole_sequences(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.detach().clone()  # (counts of chosen experts: no gradient flows through them)
        comm.all_reduce(counts, self.group)
        return counts
