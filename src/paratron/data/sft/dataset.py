"""SFT samples for training and evaluation, from conversations in memory or preprocessed.

`SFTDataset` turns tokenized conversations into `SFTSample`s: bins of conversations are fixed
once (packed or one per sample), and sample k is a pure function of (seed, k), so a resumed
run and every data-parallel rank agree without talking to each other.

Large sets are tokenized once by `paratron preprocess --sft` into two Megatron indexed
datasets that `ConversationStore` reads lazily:

    PREFIX_input_ids_document.bin/.idx   the token ids, one document per conversation
    PREFIX_trained_document.bin/.idx     uint8 1/0: whether each token is an assistant token
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from pathlib import Path

import numpy as np

from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter, dataset_exists, optimal_dtype
from paratron.data.sft.packing import (
    TRUNCATIONS,
    SFTSample,
    Truncation,
    build_sample,
    needs_truncation,
    pack_bins,
    positions_of,
)
from paratron.data.sft.templates import ChatTemplate
from paratron.data.sft.tokenize import TokenizedConversation, iter_tokenized
from paratron.data.tokenizer import Tokenizer
from paratron.errors import DataError


def _ids_prefix(prefix: str | Path) -> str:
    return f"{prefix}_input_ids_document"


def _trained_prefix(prefix: str | Path) -> str:
    return f"{prefix}_trained_document"


def sft_dataset_exists(prefix: str | Path) -> bool:
    return dataset_exists(_ids_prefix(prefix)) and dataset_exists(_trained_prefix(prefix))


class ConversationStore(Sequence[TokenizedConversation]):
    """The conversations written by `write_sft_dataset`, read from disk one at a time."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        self._ids = IndexedDataset(_ids_prefix(prefix))
        self._trained = IndexedDataset(_trained_prefix(prefix))
        if not np.array_equal(self._ids.sequence_lengths, self._trained.sequence_lengths):
            raise DataError(
                f"{self.prefix}: the _input_ids_document and _trained_document files do not describe the "
                "same conversations (written by different runs?); run paratron preprocess --sft again"
            )

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: int) -> TokenizedConversation:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"conversation {index} is outside the {len(self)} of {self.prefix}")
        index %= len(self)
        return TokenizedConversation(
            self._ids.get(index).astype(np.int32),
            self._trained.get(index).astype(bool),
            f"{self.prefix}: conversation {index}",
        )

    def trained_flags(self, index: int) -> np.ndarray:
        return self._trained.get(index)

    @property
    def token_counts(self) -> np.ndarray:
        """Each conversation's length in tokens, without reading the tokens."""
        return np.asarray(self._ids.sequence_lengths, dtype=np.int64)


def write_sft_dataset(
    conversations: Iterable[TokenizedConversation], output_prefix: str, vocab_size: int | None = None
) -> tuple[int, int]:
    """Write the two indexed datasets; returns (conversations, tokens). Nothing lands under the
    final names unless every conversation was written (the writer renames temporary files)."""
    count = tokens = 0
    with (  # each writer finalizes on success and removes its files on any error
        IndexedDatasetWriter(_ids_prefix(output_prefix), optimal_dtype(vocab_size)) as ids_writer,
        IndexedDatasetWriter(_trained_prefix(output_prefix), np.uint8) as trained_writer,
    ):
        for conversation in conversations:
            ids_writer.add_document(np.asarray(conversation.ids))
            trained_writer.add_document(np.asarray(conversation.trained, dtype=np.uint8))
            count += 1
            tokens += len(conversation.ids)
        if count == 0:
            raise DataError(f"{output_prefix}: no conversations to write")
    return count, tokens


def preprocess_sft(
    files: list[Path], output_prefix: str, template: ChatTemplate, tokenizer: Tokenizer
) -> tuple[int, int]:
    """Tokenize every conversation of `files` (in order) into one preprocessed dataset."""
    conversations = chain.from_iterable(iter_tokenized(path, template, tokenizer) for path in files)
    return write_sft_dataset(conversations, output_prefix, tokenizer.vocab_size)


def _token_counts(conversations: Sequence[TokenizedConversation]) -> np.ndarray:
    if isinstance(conversations, ConversationStore):
        return conversations.token_counts
    return np.fromiter((len(c.ids) for c in conversations), dtype=np.int64, count=len(conversations))


def _trained_flags(conversations: Sequence[TokenizedConversation]) -> Callable[[int], np.ndarray]:
    """Conversation i's trained flags, without reading its token ids from a store."""
    if isinstance(conversations, ConversationStore):
        return conversations.trained_flags
    return lambda i: conversations[i].trained


class SFTDataset:
    """Samples of `seq_length` positions from conversations: `len(ds)` and `ds[k] -> SFTSample`.

    With `num_samples=None`, one epoch in the original order (evaluation over whole files);
    otherwise `num_samples` samples, epoch e in the order of a permutation seeded by seed + e.
    """

    def __init__(
        self,
        conversations: Sequence[TokenizedConversation],
        seq_length: int,
        pad_id: int,
        pack: bool,
        num_samples: int | None,
        seed: int,
        truncation: Truncation,
        name: str,
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation {truncation!r} is not one of {TRUNCATIONS}")
        if len(conversations) == 0:
            raise DataError(f"{name}: no conversations")
        self.conversations = conversations
        self.seq_length, self.pad_id, self.seed, self.name = seq_length, pad_id, seed, name
        self.num_samples = num_samples
        positions = _token_counts(conversations) - 1
        self.truncated = self._count_truncated(positions, truncation)
        positions = np.minimum(positions, seq_length)
        self.bins = pack_bins(positions, seq_length) if pack else [np.array([i]) for i in range(len(positions))]
        self.samples_per_epoch = len(self.bins)
        self.trained_tokens_per_epoch = self._count_trained_tokens()
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def _count_truncated(self, positions: np.ndarray, truncation: Truncation) -> int:
        too_long = np.flatnonzero(positions > self.seq_length)
        if too_long.size:  # raises under "error", naming the first one
            needs_truncation(self.conversations[int(too_long[0])], self.seq_length, truncation)
        return int(too_long.size)

    def _count_trained_tokens(self) -> int:
        """Positions with a label, over one epoch after truncation (the loss's token count)."""
        flags = _trained_flags(self.conversations)
        return sum(int(np.count_nonzero(flags(i)[1 : self.seq_length + 1])) for i in range(len(self.conversations)))

    def __len__(self) -> int:
        return self.samples_per_epoch if self.num_samples is None else self.num_samples

    def bin_of(self, k: int) -> np.ndarray:
        """The conversation indices of sample k."""
        if not 0 <= k < len(self):
            raise IndexError(f"sample {k} is outside {self.name}'s {len(self)}")
        if self.num_samples is None:
            return self.bins[k]
        epoch, within = divmod(k, self.samples_per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.RandomState(self.seed + epoch).permutation(self.samples_per_epoch)
        return self.bins[int(self._order[within])]

    def __getitem__(self, k: int) -> SFTSample:
        parts = [positions_of(self.conversations[int(i)], self.seq_length) for i in self.bin_of(k)]
        return build_sample(parts, self.seq_length, self.pad_id)
