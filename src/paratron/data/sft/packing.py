"""Tokenized conversations -> fixed-length training samples.

A conversation of n tokens gives n - 1 positions: position j reads token j and is trained to
predict token j + 1 when that token is an assistant token (else its label is IGNORE_INDEX).
Packing puts several conversations into one sample of `seq_length` positions; each keeps its
own positions (restarting at 0) and segment id, so attention and rotary positions see each
conversation as if it were alone. Padding is one more segment, so it never attends to a
conversation and every row of the attention mask has at least its own position.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from paratron.data.sft.tokenize import TokenizedConversation
from paratron.errors import DataError
from paratron.model.batch import IGNORE_INDEX

Truncation = Literal["truncate", "error"]
TRUNCATIONS = ("truncate", "error")


class SFTSample(NamedTuple):
    """One training sample; four int64 arrays of seq_length entries."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray


def positions_of(conversation: TokenizedConversation, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of the conversation's first `seq_length` positions, int64."""
    ids = np.asarray(conversation.ids[: seq_length + 1], dtype=np.int64)
    trained = np.asarray(conversation.trained[1 : seq_length + 1], dtype=bool)
    return ids[:-1], np.where(trained, ids[1:], IGNORE_INDEX)


def needs_truncation(conversation: TokenizedConversation, seq_length: int, truncation: Truncation) -> bool:
    """Whether the conversation is longer than a sample; under "error", raise instead."""
    positions = len(conversation.ids) - 1
    if positions <= seq_length:
        return False
    if truncation == "error":
        raise DataError(
            f"{conversation.where or 'a conversation'}: {positions + 1} tokens do not fit a sample of "
            f"--seq-length {seq_length} ({seq_length + 1} tokens), and --no-truncate (--sft-truncation error) "
            "refuses to cut it; raise --seq-length or drop the long conversations"
        )
    return True


def pack_bins(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Best-fit decreasing: each item, longest first (ties by index), goes into the open bin
    it fills most tightly (ties by the older bin), or opens a new one. Returns each bin's
    item indices, ascending; bins in the order they were opened."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.max() > capacity or lengths.min() < 0):
        raise ValueError(f"lengths {lengths.min()}..{lengths.max()} do not fit bins of {capacity}")
    order = np.lexsort((np.arange(len(lengths)), -lengths))
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin number), sorted
    for item in order.tolist():
        length = int(lengths[item])
        slot = bisect_left(open_bins, (length, -1))
        if slot < len(open_bins):
            room, number = open_bins.pop(slot)
        else:
            room, number = capacity, len(bins)
            bins.append([])
        bins[number].append(item)
        if room - length > 0:
            insort(open_bins, (room - length, number))
    return [np.array(sorted(b), dtype=np.int64) for b in bins]


def build_sample(parts: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int, pad_id: int) -> SFTSample:
    """Concatenate (input_ids, labels) pieces into one sample, padded to `seq_length`."""
    used = sum(len(inputs) for inputs, _ in parts)
    if used > seq_length:
        raise ValueError(f"{used} positions do not fit a sample of {seq_length}")
    padding = seq_length - used
    sizes = [len(inputs) for inputs, _ in parts] + [padding]
    inputs = np.concatenate([p[0] for p in parts] + [np.full(padding, pad_id, dtype=np.int64)])
    labels = np.concatenate([p[1] for p in parts] + [np.full(padding, IGNORE_INDEX, dtype=np.int64)])
    positions = np.concatenate([np.arange(size, dtype=np.int64) for size in sizes])
    segments = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    return SFTSample(inputs.astype(np.int64), labels.astype(np.int64), positions, segments)
