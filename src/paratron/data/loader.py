"""Cutting a global batch into this rank's micro-batches.

Megatron-LM's order: a global batch of G samples is consumed as G / (mbs x DP) steps;
at each step the next mbs x DP samples are split, data-parallel rank r taking the r-th
block of mbs. One process (DP = 1) therefore sees the same samples in the same order as
all DP ranks together, which is what makes every layout comparable to the single run.

A pretraining sample is seq_length + 1 tokens (inputs, and labels shifted by one); with
Megatron-LM's --reset-position-ids, --reset-attention-mask and --eod-mask-loss its documents
(ended by the end-of-document token) also get their own positions, attention and loss mask.
A fine-tuning sample (`data.sft.SFTSample`) arrives with its labels, positions and segments.

Megatron-LM's data loader flags act on a `LoaderSource`, which wraps the training (and
validation) samples: --dataloader-type cyclic reorders the samples as Megatron's
MegatronPretrainingRandomSampler, and --num-workers N reads and collates the training
micro-batches ahead in N torch DataLoader worker processes. Either way a step's batches are a
pure function of (consumed samples, layout), so workers change only when they are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import numpy as np
import torch

from paratron.config.layout import BatchPlan
from paratron.config.schema import DataConfig, ModelConfig
from paratron.data.datasets import SampleSource
from paratron.data.vision import VisionSample
from paratron.model.attention import ATTENTION_TYPES
from paratron.model.batch import IGNORE_INDEX, Batch


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


def document_arrays(
    inputs: np.ndarray, labels: np.ndarray, documents: DocumentLayout
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """For samples [B, T] of pretraining tokens: the labels (end-of-document tokens' masked with
    --eod-mask-loss), the positions (restarting at each document with --reset-position-ids, else
    None) and the segments (documents numbered, with --reset-attention-mask, else None). A document
    ends with (and includes) its end-of-document token; the next one starts after it."""
    ends = inputs == documents.eod_id
    segments = np.cumsum(ends, axis=1) - ends  # end-of-document tokens before each position
    positions = None
    if documents.reset_position_ids:
        index = np.arange(inputs.shape[1])
        starts = np.zeros_like(inputs)
        starts[:, 1:] = np.where(ends[:, :-1], index[1:], 0)
        positions = index - np.maximum.accumulate(starts, axis=1)
    if documents.eod_mask_loss:
        labels = np.where(ends, IGNORE_INDEX, labels)
    return labels, positions, segments if documents.reset_attention_mask else None


def pretraining_batch(tokens: np.ndarray, documents: DocumentLayout) -> Batch:
    """A micro-batch from samples [B, seq_length + 1] (`document_arrays` says how documents count)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if documents.plain:
        return Batch(torch.from_numpy(inputs), torch.from_numpy(labels))
    labels, positions, segments = document_arrays(inputs, labels, documents)
    return Batch(
        torch.from_numpy(np.ascontiguousarray(inputs)),
        torch.from_numpy(np.ascontiguousarray(labels)),
        None if positions is None else torch.from_numpy(positions),
        None if segments is None else torch.from_numpy(segments),
    )


def collate(samples: list, documents: DocumentLayout) -> Batch:
    """One micro-batch of samples: token arrays (pretraining), `SFTSample`s (fine-tuning) or `VisionSample`s
    (their images one after another, in the rows' order)."""
    if isinstance(samples[0], np.ndarray):
        return pretraining_batch(np.stack(samples), documents)
    if any(isinstance(sample, VisionSample) for sample in samples):  # (evaluation pads with image-less samples)
        arrays = [torch.from_numpy(np.stack(column)) for column in zip(*(sample[:4] for sample in samples))]
        return Batch(*arrays, images=torch.cat([s.images for s in samples if isinstance(s, VisionSample)]))
    fields = [torch.from_numpy(np.stack(column)) for column in zip(*samples)]
    return Batch(*fields)


def cyclic_sample_indices(plan: BatchPlan, consumed_samples: int, total: int, sharding: bool) -> list[list[int]]:
    """Megatron-LM's MegatronPretrainingRandomSampler (--dataloader-type cyclic), as a function of the
    consumed count: epochs of the largest multiple A of mbs x DP samples; epoch e is shuffled by
    torch.randperm seeded with e. With sharding, rank r shuffles its own block of A / DP samples; without,
    one permutation of the samples (to a multiple of mbs) is dealt out to the ranks in turn."""
    mbs, dp, rank = plan.micro_batch_size, plan.dp_size, plan.dp_rank
    active = total - total % (mbs * dp)
    if active == 0:
        raise ValueError(f"{total} samples are fewer than one micro-batch per data-parallel rank")
    out = []
    for m in range(plan.num_micro_batches):
        epoch, in_epoch = divmod(consumed_samples + m * mbs * dp, active)
        if sharding:
            bucket = active // dp
            order = _epoch_order(bucket, epoch)
            out.append((rank * bucket + order[in_epoch // dp : in_epoch // dp + mbs]).tolist())
        else:
            order = _epoch_order(total - total % mbs, epoch)
            out.append(order[in_epoch + rank : in_epoch + rank + dp * mbs : dp].tolist())
    return out


@lru_cache(maxsize=2)
def _epoch_order(size: int, epoch: int) -> np.ndarray:
    """torch.randperm(size) seeded with the epoch, as Megatron's cyclic sampler draws it (cached: every
    micro-batch of an epoch reads the same one)."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(epoch)).numpy()


class _Samples(torch.utils.data.Dataset):
    """A sample source as a torch map-style dataset (what DataLoader workers read)."""

    def __init__(self, source: SampleSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        return self.source[index]


class _BatchesFrom:
    """Batch sampler: this rank's micro-batch indices of the global batches from `start` on (read when
    an iteration begins, so that one DataLoader with persistent workers can restart anywhere)."""

    def __init__(self, source: LoaderSource, plan: BatchPlan) -> None:
        self.source, self.plan, self.start = source, plan, 0

    def __iter__(self):
        consumed, total = self.start, len(self.source)
        while True:
            batch = self.source.sample_indices(self.plan, consumed)
            if max(max(indices) for indices in batch) >= total:
                return
            yield from batch
            consumed += self.plan.global_batch_size


class _Prefetcher:
    """A torch DataLoader over one (plan, document layout), kept ahead of the training loop."""

    def __init__(self, source: LoaderSource, plan: BatchPlan, documents: DocumentLayout) -> None:
        self.sampler = _BatchesFrom(source, plan)
        self.loader = torch.utils.data.DataLoader(
            _Samples(source.source),
            batch_sampler=self.sampler,
            num_workers=source.num_workers,
            collate_fn=partial(collate, documents=documents),
            persistent_workers=True,
        )
        self.iterator = None
        self.next_consumed: int | None = None

    def batches(self, consumed_samples: int, count: int) -> list[Batch]:
        if consumed_samples != self.next_consumed:  # first use, or the run jumped (a skipped batch, a rollback)
            self.sampler.start = consumed_samples
            self.iterator = iter(self.loader)
        self.next_consumed = consumed_samples + self.sampler.plan.global_batch_size
        batches = [next(self.iterator, None) for _ in range(count)]
        if any(batch is None for batch in batches):
            self.next_consumed = None
            raise IndexError(f"the global batch at sample {consumed_samples} runs past the samples built")
        return batches


class LoaderSource:
    """Samples read the way Megatron-LM's --dataloader-type and --num-workers say (see the module's
    docstring); indexing and attributes are the wrapped source's."""

    def __init__(self, source: SampleSource, dataloader_type: str = "single", num_workers: int = 0,
                 data_sharding: bool = True) -> None:  # fmt: skip
        if dataloader_type not in ("single", "cyclic"):
            raise ValueError(f"dataloader type {dataloader_type!r} is not single or cyclic")
        self.source, self.dataloader_type = source, dataloader_type
        self.num_workers, self.data_sharding = num_workers, data_sharding
        self._prefetchers: dict[tuple, _Prefetcher] = {}

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        return self.source[index]

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # (not set yet: unpickling)
            raise AttributeError(name)
        return getattr(self.source, name)

    def sample_indices(self, plan: BatchPlan, consumed_samples: int) -> list[list[int]]:
        if self.dataloader_type == "cyclic":
            return cyclic_sample_indices(plan, consumed_samples, len(self.source), self.data_sharding)
        return plan.sample_indices(consumed_samples)

    def micro_batches(self, plan: BatchPlan, consumed_samples: int, documents: DocumentLayout) -> list[Batch]:
        if self.num_workers == 0:
            return [
                collate([self.source[i] for i in indices], documents)
                for indices in self.sample_indices(plan, consumed_samples)
            ]
        key = (plan, documents)
        if key not in self._prefetchers:
            self._prefetchers[key] = _Prefetcher(self, plan, documents)
        return self._prefetchers[key].batches(consumed_samples, plan.num_micro_batches)


def micro_batches(
    samples: SampleSource,
    plan: BatchPlan,
    consumed_samples: int,
    device: torch.device,
    documents: DocumentLayout = DocumentLayout(),
) -> list[Batch]:
    """This rank's micro-batches ([mbs, seq] each) of the global batch at `consumed_samples`, on `device`."""
    if isinstance(samples, LoaderSource):
        return [batch.to(device) for batch in samples.micro_batches(plan, consumed_samples, documents)]
    return [
        collate([samples[i] for i in indices], documents).to(device)
        for indices in plan.sample_indices(consumed_samples)
    ]
