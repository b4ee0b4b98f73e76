"""A text checkpoint as the start of a vision-language model (--finetune with a vision model).

Two parts of such a model are not in the checkpoint, and loading it accepts exactly those:

- the encoder and projector (`vision.*`), which keep the initialization the seed gives them, as a new
  projector does in LLaVA's recipe;
- with --add-image-token, the vocabulary rows of tokens the tokenizer gained (its `<image>`): the embedding and,
  untied, the output layer have more rows than the checkpoint's. The saved rows load as they are and each new
  row is the mean of the saved ones (LLaVA's recipe), so a new token starts as an average token: the logits of
  the old tokens stay what they were, and a new token's logit is the mean of theirs.

The mean is read a block of rows at a time, so no rank holds more than its own slice and one block.
"""

from __future__ import annotations

import torch

from paratron.checkpoint.pieces import Catalog
from paratron.parallel.sharding import Index

VOCABULARY_PARAMETERS = ("embedding.weight", "output.weight")
"""The parameters with one row per vocabulary id (single-device names)."""
NEW_PARTS = "vision."
"""The prefix of the parameters a text checkpoint lacks in a vision-language model."""
BLOCK_VALUES = 1 << 22
"""Values read at a time while averaging the saved rows."""


def grows(name: str, saved: tuple[int, ...], wanted: tuple[int, ...]) -> bool:
    """Parameter `name` is a vocabulary one with more rows here than the checkpoint's `saved` shape, the same
    otherwise."""
    return name in VOCABULARY_PARAMETERS and saved[1:] == wanted[1:] and saved[0] < wanted[0]


def fill_grown(catalog: Catalog, name: str, local: torch.Tensor, pairs: list[tuple[Index, Index]]) -> None:
    """Fill this rank's boxes (`pairs`: `held_boxes`) of a grown vocabulary parameter: the saved rows from the
    checkpoint, the new ones with the saved rows' mean."""
    saved_rows = catalog.shapes[name][0]
    mean = mean_row(catalog, name).to(local.dtype)
    for whole, mine in pairs:
        rows, rest = whole[0], whole[1:]
        shift = mine[0].start - rows.start
        last_saved = min(rows.stop, saved_rows)
        if rows.start < last_saved:
            saved_box = (slice(rows.start, last_saved), *rest)
            catalog.fill(name, local, [(saved_box, (slice(rows.start + shift, last_saved + shift), *mine[1:]))])
        first_new = max(rows.start, saved_rows)
        if first_new < rows.stop:
            local[(slice(first_new + shift, rows.stop + shift), *mine[1:])] = mean[rest]


def mean_row(catalog: Catalog, name: str) -> torch.Tensor:
    """The mean of the saved rows of `name`, summed in float64 a block of rows at a time."""
    shape = catalog.shapes[name]
    rows, rest = shape[0], tuple(shape[1:])
    width = max(1, int(torch.Size(rest).numel()))
    step = max(1, BLOCK_VALUES // width)
    total = torch.zeros(rest, dtype=torch.float64)
    buffer = torch.empty((min(step, rows), *rest), dtype=torch.float64)
    columns = tuple(slice(0, n) for n in rest)
    for first in range(0, rows, step):
        last = min(first + step, rows)
        block = buffer[: last - first]
        catalog.fill(name, block, [((slice(first, last), *columns), (slice(0, last - first), *columns))])
        total += block.sum(0)
    return total / rows
