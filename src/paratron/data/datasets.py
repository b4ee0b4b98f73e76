"""What the loader draws samples from, and deterministic synthetic samples (--mock-data).

A sample is seq_length + 1 consecutive tokens: the inputs and, shifted by one, the labels. (A vision-language
model's samples are `data.vision.VisionSample`s.)
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


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
