"""Cutting a global batch into this rank's micro-batches.

Megatron-LM's order: a global batch of G samples is consumed as G / (mbs x DP) steps;
at each step the next mbs x DP samples are split, data-parallel rank r taking the r-th
block of mbs. One process (DP = 1) therefore sees the same samples in the same order as
all DP ranks together, which is what makes every layout comparable to the single run.

A pretraining sample is seq_length + 1 tokens (inputs, and labels shifted by one); with
Megatron-LM's --reset-position-ids, --reset-attention-mask and --eod-mask-loss its documents
(ended by the end-of-document token) also get their own positions, attention and loss mask.
A fine-tuning sample (`data.sft.SFTSample`) arrives with its labels, positions and segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paratron.config.layout import micro_batches_per_rank
from paratron.config.schema import DataConfig, ModelConfig
from paratron.data.datasets import SampleSource
from paratron.model.attention import ATTENTION_TYPES
from paratron.model.batch import IGNORE_INDEX, Batch


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


@dataclass(frozen=True)
class DocumentLayout:
    """How pretraining samples treat the documents inside them (all off: one causal sequence)."""

    eod_id: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def of(cls, data: DataConfig, model: ModelConfig, eod_id: int | None) -> DocumentLayout:
        """A run's layout: its --reset-* and --eod-mask-loss flags; an attention pattern that reads
        documents (`--attention-type document`) marks them as --reset-attention-mask does."""
        attention = data.reset_attention_mask or ATTENTION_TYPES[model.attention_type].needs_segments
        return cls(eod_id, data.reset_position_ids, attention, data.eod_mask_loss)

    @property
    def plain(self) -> bool:
        return not (self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss)


def pretraining_batch(tokens: np.ndarray, documents: DocumentLayout) -> Batch:
    """A micro-batch from samples [B, seq_length + 1]: a document ends with (and includes) its
    end-of-document token; the next one starts after it."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if documents.plain:
        return Batch(torch.from_numpy(inputs), torch.from_numpy(labels))
    ends = inputs == documents.eod_id
    segments = np.cumsum(ends, axis=1) - ends  # end-of-document tokens before each position
    positions = None
    if documents.reset_position_ids:
        index = np.arange(inputs.shape[1])
        starts = np.zeros_like(inputs)
        starts[:, 1:] = np.where(ends[:, :-1], index[1:], 0)
        positions = torch.from_numpy(index - np.maximum.accumulate(starts, axis=1))
    if documents.eod_mask_loss:
        labels = np.where(ends, IGNORE_INDEX, labels)
    return Batch(
        torch.from_numpy(np.ascontiguousarray(inputs)),
        torch.from_numpy(np.ascontiguousarray(labels)),
        positions,
        torch.from_numpy(segments) if documents.reset_attention_mask else None,
    )


def collate(samples: list, documents: DocumentLayout) -> Batch:
    """One micro-batch of samples: token arrays (pretraining) or `SFTSample`s (fine-tuning)."""
    if isinstance(samples[0], np.ndarray):
        return pretraining_batch(np.stack(samples), documents)
    fields = [torch.from_numpy(np.stack(column)) for column in zip(*samples)]
    return Batch(*fields)


def micro_batches(
    samples: SampleSource,
    plan: BatchPlan,
    consumed_samples: int,
    device: torch.device,
    documents: DocumentLayout = DocumentLayout(),
) -> list[Batch]:
    """This rank's micro-batches ([mbs, seq] each) of the global batch at `consumed_samples`, on `device`."""
    return [
        collate([samples[i] for i in indices], documents).to(device)
        for indices in plan.sample_indices(consumed_samples)
    ]
