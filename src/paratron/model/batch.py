"""What one micro-batch holds: token ids, the labels to predict, and how sequences are laid out.

A row of a micro-batch may hold several documents or conversations one after another
(packing). `position_ids` then restart at 0 for each, and `segment_ids` number them, so that a
token attends only to earlier tokens of its own segment. Labels equal to `IGNORE_INDEX` are not
trained (user turns of a conversation, padding, the token after an end-of-document with
--eod-mask-loss); every loss is a sum or mean over the other labels only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
"""A label that is not trained (as in PyTorch's cross-entropy and Hugging Face's labels)."""


@dataclass
class Batch:
    input_ids: torch.Tensor
    """[B, T] token ids."""
    labels: torch.Tensor
    """[B, T] the next token at each position, or IGNORE_INDEX where nothing is trained."""
    position_ids: torch.Tensor | None = None
    """[B, T] position of each token within its segment (None: 0, 1, ..., T - 1 in every row)."""
    segment_ids: torch.Tensor | None = None
    """[B, T] which segment of its row each token belongs to (None: one segment per row)."""
    token_index: torch.Tensor | None = None
    """[T'] when the batch holds only some tokens of each row (context parallelism): their places
    in the row; `position_ids` and `segment_ids` then still cover the whole row."""
    images: torch.Tensor | None = None
    """[N, 3, H, W] the images of a vision-language micro-batch (float pixel values), in the order their
    placeholder tokens appear in the rows, row after row (None or N = 0: no image)."""

    @property
    def seq_length(self) -> int:
        return self.input_ids.size(1)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def trained_tokens(self) -> torch.Tensor:
        """How many labels are trained (a tensor on the batch's device: no host sync)."""
        return (self.labels != IGNORE_INDEX).sum()

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            move(self.input_ids),  # type: ignore[arg-type]
            move(self.labels),  # type: ignore[arg-type]
            move(self.position_ids),
            move(self.segment_ids),
            move(self.token_index),
            move(self.images),
        )
