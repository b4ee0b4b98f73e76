"""Synthetic image-text samples (--mock-data with a vision model): token rows with 0, 1 or 2
random images each, for testing and benchmarking without data files.

Sample k depends only on (seed, k). The text is an arithmetic progression over the vocabulary
without the image token (as `MockTokens`, so a model can learn it); each image's placeholder run
of `tokens_per_image` image tokens sits at a random place, and no label is an image token.
"""

from __future__ import annotations

import numpy as np
import torch

from paratron.data.vision.dataset import VisionSample
from paratron.errors import ConfigError
from paratron.model.batch import IGNORE_INDEX

MAX_IMAGES = 2


class MockVisionSamples:
    """`len(ds)` and `ds[k] -> VisionSample` of `seq_length` positions (one segment, no padding)."""

    def __init__(
        self,
        vocab_size: int,
        seq_length: int,
        image_token_id: int,
        tokens_per_image: int,
        image_size: int | tuple[int, int],
        seed: int,
        size: int = 1 << 40,
    ) -> None:
        if not 0 <= image_token_id < vocab_size or vocab_size < 2:
            raise ConfigError(f"the image token id {image_token_id} must be one of the {vocab_size} vocabulary ids")
        if tokens_per_image >= seq_length:
            raise ConfigError(
                f"--seq-length {seq_length} cannot hold one image's {tokens_per_image} tokens and any text; "
                "raise --seq-length"
            )
        self.vocab_size, self.seq_length, self.seed, self.size = vocab_size, seq_length, seed, size
        self.image_token_id, self.tokens_per_image = image_token_id, tokens_per_image
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else image_size  # (height, width)
        self.max_images = min(MAX_IMAGES, (seq_length - 1) // tokens_per_image)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> VisionSample:
        rng = np.random.default_rng([self.seed, index])
        images = int(rng.integers(self.max_images + 1))
        text_length = self.seq_length + 1 - images * self.tokens_per_image
        start, step = int(rng.integers(self.vocab_size - 1)), int(rng.integers(1, 8))
        text = (start + step * np.arange(text_length, dtype=np.int64)) % (self.vocab_size - 1)
        text += text >= self.image_token_id  # skip the image token's id
        places = np.sort(rng.choice(text_length - 1, size=images))  # never after the last token
        row = text
        for place in places[::-1]:  # from the right, so earlier places keep their index
            run = np.full(self.tokens_per_image, self.image_token_id, dtype=np.int64)
            row = np.concatenate([row[:place], run, row[place:]])
        targets = row[1:]
        labels = np.where(targets == self.image_token_id, IGNORE_INDEX, targets)
        pixels = rng.standard_normal((images, 3, *self.image_size), dtype=np.float32)
        positions = np.arange(self.seq_length, dtype=np.int64)
        return VisionSample(
            row[:-1], labels, positions, np.zeros(self.seq_length, dtype=np.int64), torch.from_numpy(pixels)
        )
