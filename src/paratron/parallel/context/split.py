"""Which tokens of a row each context-parallel rank holds, and this rank's part of a micro-batch.

A row of T tokens is cut into 2 CP chunks of T / 2CP; rank i holds chunks i and 2CP - 1 - i.
Under a causal mask a later chunk attends to more keys than an earlier one, and this pairing
gives every rank the same work (Megatron-LM's load balance).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from paratron.model.batch import Batch


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp_size) that `cp_rank` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def token_index(length: int, cp_size: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[length / cp_size] the places in the row of the tokens `cp_rank` holds, in order."""
    chunk = length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp_size, cp_rank)])


def split_batch(batch: Batch, cp_size: int, cp_rank: int) -> Batch:
    """This rank's tokens and labels of `batch`; positions and segments stay whole (attention and
    rotary embeddings read the true places of every token)."""
    index = token_index(batch.seq_length, cp_size, cp_rank, batch.device)
    return replace(batch, input_ids=batch.input_ids[:, index], labels=batch.labels[:, index], token_index=index)
