"""What the loader draws samples from, and deterministic synthetic samples (--mock-data).

A pretraining sample is seq_length + 1 consecutive tokens: the inputs and, shifted by one, the labels. A
vision-language sample (`VisionSample`) comes with its labels and images.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch

from paratron.model.batch import IGNORE_INDEX


class SampleSource(Protocol):
    """Global sample index -> tokens [seq_length + 1] (int64); GPTDataset, BlendedDataset, MockTokens."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> np.ndarray: ...


class MockTokens:
    """Deterministic synthetic samples: arithmetic progressions modulo the vocabulary.

    Sample i depends only on (seed, i). A model can learn to continue a progression, so
    the loss falls quickly and a broken training step shows.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int, size: int = 1 << 40) -> None:
        self.vocab_size, self.seq_length, self.seed, self.size = vocab_size, seq_length, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        start = int(rng.integers(self.vocab_size))
        step = int(rng.integers(1, 8))
        return (start + step * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size


class VisionSample(NamedTuple):
    """One vision-language sample: token arrays of seq_length entries (positions and segments None for one
    sequence per row) and its images [n, 3, H, W], in the order of their placeholders (n may be 0)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray | None
    segment_ids: np.ndarray | None
    images: torch.Tensor


class MockVisionSamples:
    """Deterministic synthetic vision-language samples (--mock-data with a vision model): `MockTokens`' progressions
    with 0, 1 or 2 random images each, their placeholders at random places. A placeholder is never a label (the
    token before it is not trained); the token after an image's last placeholder is. Sample i depends only on
    (seed, i)."""

    def __init__(
        self,
        vocab_size: int,
        seq_length: int,
        seed: int,
        image_shape: tuple[int, int, int],
        image_tokens: int,
        placeholder_id: int,
        size: int = 1 << 40,
    ) -> None:
        self.tokens = MockTokens(vocab_size - 1, seq_length, seed, size)  # (the last id may be the placeholder)
        self.seq_length, self.seed, self.size = seq_length, seed, size
        self.image_shape, self.image_tokens, self.placeholder_id = image_shape, image_tokens, placeholder_id

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> VisionSample:
        rng = np.random.default_rng([self.seed, index, 1])
        tokens = self.tokens[index].copy()
        fits = (self.seq_length - 1) // self.image_tokens  # (images whose placeholders fit the inputs)
        count = min(int(rng.integers(3)), fits)
        starts = np.sort(rng.choice(fits, size=count, replace=False)) * self.image_tokens if count else []
        for start in starts:
            tokens[start : start + self.image_tokens] = self.placeholder_id
        inputs, labels = tokens[:-1], tokens[1:].copy()
        labels[labels == self.placeholder_id] = IGNORE_INDEX
        generator = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
        images = torch.randn((count, *self.image_shape), generator=generator)
        return VisionSample(inputs, labels, None, None, images)
