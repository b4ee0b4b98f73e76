"""Blending datasets by weight, Megatron-LM style (`--data-path 0.3 A 0.7 B`).

Sample k of the blend goes to the dataset whose drawn count lags its weight the most
(weight x k - drawn so far, ties to the first), so at every prefix of training each
dataset's share is within one sample of its weight. With weights, a blend for `size`
samples holds sum(ceil(size x weight)) and asks each component for
ceil(ceil(size x weight) x 1.005), Megatron's margin. Without weights each component is
built for one epoch and weighted by its length (Megatron-LM's "weights inferred from the
lengths of the datasets").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratron.config.validation import parse_split
from paratron.data.datasets import SampleSource
from paratron.errors import ConfigError

SURPLUS = 0.005


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and, when given, their normalized weights."""

    paths: list[str]
    weights: list[float] | None


def parse_blend(values: Sequence[str], flag: str = "--data-path") -> Blend:
    """['0.3', 'A', '0.7', 'B'] -> weights [0.3, 0.7]; ['A', 'B'] -> no weights (Megatron then
    weighs the datasets by their sizes). Paths have `~` expanded."""
    values = list(values)

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    if (
        values
        and len(values) % 2 == 0
        and all(number(v) is not None for v in values[0::2])
        and all(number(v) is None for v in values[1::2])
    ):
        weights: list[float] | None = [float(w) for w in values[0::2]]
        paths = values[1::2]
    elif all(number(v) is None for v in values):
        weights, paths = None, values
    else:
        raise ConfigError(f"{flag} {' '.join(values)}: expected PREFIX..., or WEIGHT PREFIX pairs such as 0.3 A 0.7 B")
    if weights is not None:
        if any(w <= 0 for w in weights):
            raise ConfigError(f"{flag}: weights must be positive")
        weights = (np.asarray(weights, dtype=np.float64) / np.sum(weights)).tolist()  # as Megatron does
    return Blend([os.path.expanduser(p) for p in paths], weights)


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

    def __init__(
        self,
        datasets: Sequence[SampleSource],
        weights: Sequence[float],
        size: int,
        cache_dir: Path,
        build_once: Callable[[Path, Callable[[Path], None]], None],
        names: Sequence[str],
    ) -> None:
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


def split_ranges(num_documents: int, split: str) -> list[np.ndarray]:
    """Megatron's --split: contiguous ranges of sequences (documents, one sequence each, as paratron
    writes them; or conversations), boundaries rounded from the cumulative fractions."""
    fractions = parse_split(split)
    bounds = [0.0]
    for f in fractions:
        bounds.append(bounds[-1] + f)
    edges = [int(round(b * num_documents)) for b in bounds]
    edges[-1] = num_documents
    return [np.arange(edges[i], edges[i + 1], dtype=np.int32) for i in range(3)]
