"""Samples for language-model training, and their order.

A sample is seq_length + 1 consecutive tokens (inputs and shifted labels); windows over
the document stream span document boundaries, as in Megatron-LM. The order of samples
is a pure function of the seed and the global sample index, so a resumed run sees
exactly what an uninterrupted one would.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import numpy as np


class SampleSource(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> np.ndarray: ...


class TokenWindows:
    """Non-overlapping windows over a token stream; window i is tokens[i*s : i*s + s + 1]."""

    def __init__(self, tokens: np.ndarray, seq_length: int) -> None:
        self.tokens = tokens
        self.seq_length = seq_length

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_length
        return self.tokens[start : start + self.seq_length + 1].astype(np.int64)


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


class ShuffledSamples:
    """Global sample k -> source[permutation_of_epoch(k // n)[k % n]]: a fresh shuffle each epoch."""

    def __init__(self, source: SampleSource, seed: int, shuffle: bool = True) -> None:
        if len(source) == 0:
            raise ValueError("cannot draw samples from an empty source")
        self.source, self.seed, self.shuffle = source, seed, shuffle
        self._permutation = lru_cache(maxsize=2)(self._make_permutation)

    def _make_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.source))

    def __getitem__(self, k: int) -> np.ndarray:
        epoch, i = divmod(k, len(self.source))
        index = int(self._permutation(epoch)[i]) if self.shuffle else i
        return self.source[index]

    def __len__(self) -> int:
        return len(self.source)
