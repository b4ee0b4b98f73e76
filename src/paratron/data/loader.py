"""Cutting a global batch into this rank's micro-batches.

Megatron-LM's order: a global batch of G samples is consumed as G / (mbs x DP) steps;
at each step the next mbs x DP samples are split, data-parallel rank r taking the r-th
block of mbs. One process (DP = 1) therefore sees the same samples in the same order as
all DP ranks together, which is what makes every layout comparable to the single run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paratron.config.layout import micro_batches_per_rank
from paratron.data.datasets import SampleSource


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    dp_size: int
    dp_rank: int

    @property
    def num_micro_batches(self) -> int:
        return micro_batches_per_rank(self.global_batch_size, self.micro_batch_size, self.dp_size)

    def sample_indices(self, consumed_samples: int) -> list[list[int]]:
        """Global sample indices of this rank's micro-batches in the batch starting at `consumed_samples`."""
        step = self.micro_batch_size * self.dp_size
        out = []
        for m in range(self.num_micro_batches):
            first = consumed_samples + m * step + self.dp_rank * self.micro_batch_size
            out.append(list(range(first, first + self.micro_batch_size)))
        return out


def micro_batches(
    samples: SampleSource, plan: BatchPlan, consumed_samples: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) pairs of shape [mbs, seq] for this rank, on `device`."""
    batches = []
    for indices in plan.sample_indices(consumed_samples):
        tokens = torch.from_numpy(np.stack([samples[i] for i in indices]))
        tokens = tokens.to(device, non_blocking=True)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches
