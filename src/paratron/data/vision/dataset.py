"""Image-text samples for training and evaluation.

`VisionSFTDataset` is `SFTDataset` (the same bins, packing, truncation and order: sample k is a
pure function of (seed, k)) whose samples also carry the pixels of their images, decoded when the
sample is drawn, so that the work happens in data-loader workers. A sample's images are in the
order of their placeholder tokens in the row; with packing, conversation by conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from paratron.data.sft.dataset import SFTDataset
from paratron.data.sft.packing import Truncation
from paratron.data.vision.images import ImageSettings, load_images
from paratron.data.vision.llava import VisionConversation
from paratron.errors import DataError


class VisionSample(NamedTuple):
    """`SFTSample`'s four int64 arrays of seq_length entries, and the images of the row."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    images: torch.Tensor
    """float32 [n, 3, H, W]: one tensor per image (per tile with tiling), in the order of their
    placeholders; each stands for `tokens_per_image` consecutive image tokens of `input_ids`."""


def image_tokens_end(conversation: VisionConversation, image_token_id: int) -> int:
    """One past the last image token of the conversation (0 when it has none)."""
    places = np.flatnonzero(np.asarray(conversation.ids) == image_token_id)
    return int(places[-1]) + 1 if places.size else 0


class VisionSFTDataset(SFTDataset):
    """Samples of `seq_length` positions from image-text conversations: `ds[k] -> VisionSample`.

    A conversation longer than a sample is truncated as `truncation` says, but never inside or
    before its image tokens: every image token must be an input of the sample."""

    def __init__(
        self,
        conversations: Sequence[VisionConversation],
        settings: ImageSettings,
        seq_length: int,
        pad_id: int,
        pack: bool,
        num_samples: int | None,
        seed: int,
        truncation: Truncation,
        name: str,
    ) -> None:
        self.settings = settings
        for conversation in conversations:
            _check_images_fit(conversation, settings, seq_length)
        super().__init__(conversations, seq_length, pad_id, pack, num_samples, seed, truncation, name)

    def __getitem__(self, k: int) -> VisionSample:
        sample = super().__getitem__(k)
        conversations = [self.conversations[int(i)] for i in self.bin_of(k)]
        refs = [ref for conversation in conversations for ref in conversation.images]  # type: ignore[attr-defined]
        where = ", ".join(c.where for c in conversations)
        return VisionSample(*sample, load_images(refs, self.settings, where))


def _check_images_fit(conversation: VisionConversation, settings: ImageSettings, seq_length: int) -> None:
    placeholders = int(np.count_nonzero(np.asarray(conversation.ids) == settings.image_token_id))
    if placeholders != sum(ref.tiles for ref in conversation.images) * settings.tokens_per_image:
        raise ValueError(f"{conversation.where}: tokenized with other image settings than {settings}")
    end = image_tokens_end(conversation, settings.image_token_id)
    if end > seq_length:
        tiles = sum(ref.tiles for ref in conversation.images)
        raise DataError(
            f"{conversation.where}: its image tokens ({tiles} image tensor(s) x {settings.tokens_per_image}) end at "
            f"token {end}, beyond a sample of --seq-length {seq_length}; raise --seq-length, use fewer tiles "
            "(--max-num-tiles) or images, or shorten the text before the images"
        )
