"""Blending datasets by weight, Megatron-LM style (`--data-path 0.3 A 0.7 B`).

Sample k of the blend goes to the dataset whose drawn count lags its weight the most
(weight x k - drawn so far, ties to the first), so at every prefix of training each
dataset's share is within one sample of its weight. Each component is asked for
ceil(ceil(size x weight) x 1.005) samples, Megatron's margin.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from paratron.data.datasets import SampleSource
from paratron.errors import ConfigError

SURPLUS = 0.005


def parse_blend(values: Sequence[str], flag: str = "--data-path") -> list[tuple[float, str]]:
    """['0.3', 'A', '0.7', 'B'] -> [(0.3, 'A'), (0.7, 'B')]; ['A', 'B'] -> equal weights."""
    values = list(values)
    if not values:
        return []

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    weights = [number(v) for v in values[0::2]]
    if len(values) % 2 == 0 and all(w is not None for w in weights) and \
            all(number(v) is None for v in values[1::2]):
        pairs = [(float(w), p) for w, p in zip(values[0::2], values[1::2])]  # type: ignore[arg-type]
    elif all(number(v) is None for v in values):
        pairs = [(1.0, p) for p in values]
    else:
        raise ConfigError(f"{flag} {' '.join(values)}: expected PREFIX..., or WEIGHT PREFIX pairs such as "
                          "0.3 A 0.7 B")
    if any(w <= 0 for w, _ in pairs):
        raise ConfigError(f"{flag}: weights must be positive")
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def component_sizes(weights: Sequence[float], size: int) -> list[int]:
    return [int(math.ceil(math.ceil(size * w) * (1 + SURPLUS))) for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset, and which of that dataset's samples."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    drawn = [0] * len(weights)
    for k in range(size):
        scale = max(float(k), 1.0)
        best, best_error = 0, weights[0] * scale - drawn[0]
        for d in range(1, len(weights)):
            error = weights[d] * scale - drawn[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[k] = best
        dataset_sample_index[k] = drawn[best]
        drawn[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights."""

    def __init__(self, datasets: Sequence[SampleSource], weights: Sequence[float], size: int, cache_dir: Path,
                 build_once: Callable[[Path, Callable[[Path], None]], None], names: Sequence[str]) -> None:
        self.datasets, self.weights, self.size = list(datasets), list(weights), size
        description = {"class": "BlendedDataset", "weights": list(weights), "size": size, "datasets": list(names)}
        digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
        folder = cache_dir / f"blend-{digest}"

        def build(tmp: Path) -> None:
            dataset_index, sample_index = blending_indices(self.weights, size)
            tmp.mkdir(parents=True)
            np.save(tmp / "dataset_index.npy", dataset_index)
            np.save(tmp / "dataset_sample_index.npy", sample_index)
            (tmp / "description.json").write_text(json.dumps(description, indent=2))

        build_once(folder, build)
        self.dataset_index = np.load(folder / "dataset_index.npy", mmap_mode="r")
        self.dataset_sample_index = np.load(folder / "dataset_sample_index.npy", mmap_mode="r")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> np.ndarray:
        if not 0 <= k < self.size:
            raise IndexError(f"sample {k} is outside the blend of {self.size}")
        return self.datasets[int(self.dataset_index[k])][int(self.dataset_sample_index[k])]
