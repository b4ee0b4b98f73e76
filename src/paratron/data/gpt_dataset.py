"""GPT training samples over an indexed dataset, in Megatron-LM's order.

For the documents of one split and a number of samples to draw, three index arrays fix
everything (Megatron-LM's GPTDataset, reimplemented and checked against it in
tests/unit/test_gpt_dataset.py):

- epochs: the fewest E with E x tokens_per_epoch >= samples x seq_length + 1;
- document index: the split's documents repeated E times and shuffled with
  `numpy.random.RandomState(seed)`; when the last epoch would contribute under 80% of an
  epoch's samples it is shuffled on its own, after the others, so it is not spread thin;
- sample index: sample i is the seq_length + 1 tokens starting at position i x seq_length
  of the document stream (samples cross document boundaries and share one token with the
  next); stored as (position in the document index, offset in that document);
- shuffle index: a permutation of the samples (again with a separate final epoch).

The arrays are built once, by local rank 0, and cached under a hash of everything that
shapes them, so other ranks, later runs and resumed runs read the same order.

`StreamWindows` reads a whole dataset once, in its own order and without a remainder, for
`paratron evaluate`: the same windows of seq_length + 1 tokens over the unshuffled stream, the
last one shorter and padded with labels that score nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from paratron.data.indexed import IndexedDataset
from paratron.data.loader import DocumentLayout, document_arrays
from paratron.data.sft.packing import SFTSample
from paratron.errors import DataError
from paratron.model.batch import IGNORE_INDEX

ADD_EXTRA_TOKEN = 1
FINAL_EPOCH_THRESHOLD = 0.80
SAMPLE_CHUNK = 1 << 22


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    if num_samples is None:  # one epoch
        return 1
    requested = num_samples * seq_length + ADD_EXTRA_TOKEN
    return max(1, -(-requested // tokens_per_epoch))


def _shuffled_documents(documents: np.ndarray, epochs: int, rng: np.random.RandomState) -> np.ndarray:
    index = np.tile(documents.astype(np.int32), epochs)
    rng.shuffle(index)
    return index


def _shuffled_range(start: int, stop: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if stop < np.iinfo(np.uint32).max - 1 else np.int64
    index = np.arange(start, stop, dtype=dtype)
    rng.shuffle(index)
    return index


def build_sample_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for drawing `num_samples` samples (None: one
    epoch's worth) of `seq_length` + 1 tokens from `documents` (indices into `sequence_lengths`)."""
    lengths = np.asarray(sequence_lengths)
    tokens_per_epoch = int(lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= ADD_EXTRA_TOKEN:
        raise DataError(f"the split holds {tokens_per_epoch} tokens, too few for a sample; give it more data")
    epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if epochs > 1 and num_samples is not None:
        samples_before_final = ((epochs - 1) * tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
        samples_per_epoch = (tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
        separate_final_epoch = num_samples - samples_before_final < int(FINAL_EPOCH_THRESHOLD * samples_per_epoch)

    rng = np.random.RandomState(seed)
    if separate_final_epoch:
        document_index = np.concatenate(
            [_shuffled_documents(documents, epochs - 1, rng), _shuffled_documents(documents, 1, rng)]
        )
    else:
        document_index = _shuffled_documents(documents, epochs, rng)

    # Sample i starts at stream position i * seq_length; find its document and offset, in chunks
    # so that temporaries stay small next to the result.
    total_samples = (epochs * tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
    ends = np.cumsum(lengths[document_index], dtype=np.int64)
    index_dtype = (
        np.int32
        if len(document_index) < np.iinfo(np.int32).max and lengths.max() < np.iinfo(np.int32).max
        else np.int64
    )
    sample_index = np.empty((total_samples + 1, 2), dtype=index_dtype)
    for first in range(0, total_samples + 1, SAMPLE_CHUNK):
        starts = np.arange(first, min(first + SAMPLE_CHUNK, total_samples + 1), dtype=np.int64) * seq_length
        position = np.searchsorted(ends, starts, side="right")
        sample_index[first : first + len(starts), 0] = position
        sample_index[first : first + len(starts), 1] = starts - (ends[position] - lengths[document_index[position]])
    sample_index[0] = 0  # the stream starts at the first document, even an empty one

    if separate_final_epoch:
        shuffle_index = np.concatenate(
            [_shuffled_range(0, samples_before_final, rng), _shuffled_range(samples_before_final, total_samples, rng)]
        )
    else:
        shuffle_index = _shuffled_range(0, total_samples, rng)
    return document_index, sample_index, shuffle_index


class GPTDataset:
    """Samples of seq_length + 1 tokens (inputs and shifted labels) from one split of an indexed dataset."""

    def __init__(
        self,
        dataset: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        num_samples: int | None,
        seed: int,
        cache_dir: Path,
        build_once: Callable[[Path, Callable[[Path], None]], None],
    ) -> None:
        self.dataset, self.seq_length = dataset, seq_length
        index_file = Path(f"{dataset.prefix}.idx").stat()
        description = {
            "class": "GPTDataset",
            "dataset": str(Path(dataset.prefix).resolve()),
            "index_file": [index_file.st_size, index_file.st_mtime_ns],
            "sequences": len(dataset),
            "tokens": dataset.num_tokens,
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "seq_length": seq_length,
            "num_samples": num_samples,
            "seed": seed,
            "add_extra_token": ADD_EXTRA_TOKEN,
        }
        digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
        folder = cache_dir / f"gpt-{digest}"

        def build(tmp: Path) -> None:
            arrays = build_sample_indices(dataset.sequence_lengths, documents, seq_length, num_samples, seed)
            tmp.mkdir(parents=True)
            for name, array in zip(("document_index", "sample_index", "shuffle_index"), arrays):
                np.save(tmp / f"{name}.npy", array)
            (tmp / "description.json").write_text(json.dumps(description, indent=2))

        build_once(folder, build)
        self.document_index = np.load(folder / "document_index.npy", mmap_mode="r")
        self.sample_index = np.load(folder / "sample_index.npy", mmap_mode="r")
        self.shuffle_index = np.load(folder / "shuffle_index.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, k: int) -> np.ndarray:
        if not 0 <= k < len(self):
            raise IndexError(f"sample {k} is outside the {len(self)} samples built for this split")
        i = int(self.shuffle_index[k])
        (first, first_offset), (last, last_offset) = self.sample_index[i], self.sample_index[i + 1]
        first, first_offset, last, last_offset = int(first), int(first_offset), int(last), int(last_offset)
        if first == last:
            tokens = self.dataset.get(
                int(self.document_index[first]), first_offset, last_offset - first_offset + ADD_EXTRA_TOKEN
            )
        else:
            pieces = [self.dataset.get(int(self.document_index[first]), first_offset)]
            pieces += [self.dataset.get(int(self.document_index[p])) for p in range(first + 1, last)]
            pieces.append(self.dataset.get(int(self.document_index[last]), 0, last_offset + ADD_EXTRA_TOKEN))
            tokens = np.concatenate(pieces)
        return tokens.astype(np.int64)


class StreamWindows:
    """A whole dataset as `paratron evaluate` scores it: its sequences joined into one token stream
    in the order they were written (documents in file order, with the end-of-document tokens
    preprocessing appended), cut into windows of seq_length + 1 tokens that share one token with
    the next, as training samples are. The last window may be shorter; its missing positions are
    padding whose labels are IGNORE_INDEX; `documents` is how the trained model read documents. So
    every token but the stream's first is predicted exactly once, and `trained_tokens_per_epoch` is
    the stream's length minus one."""

    def __init__(self, dataset: IndexedDataset, seq_length: int, documents: DocumentLayout | None = None) -> None:
        self.dataset, self.seq_length = dataset, seq_length
        self.documents = documents if documents is not None and not documents.plain else None
        self.lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
        self.ends = np.cumsum(self.lengths)
        self.num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        self.trained_tokens_per_epoch = max(self.num_tokens - ADD_EXTRA_TOKEN, 0)

    def __len__(self) -> int:
        return -(-self.trained_tokens_per_epoch // self.seq_length)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, as int64."""
        pieces = [np.zeros(0, dtype=np.int64)]
        sequence = int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            end = int(self.ends[sequence])
            offset = start - (end - int(self.lengths[sequence]))
            take = min(stop, end) - start
            pieces.append(self.dataset.get(sequence, offset, take).astype(np.int64))
            start, sequence = start + take, sequence + 1
        return np.concatenate(pieces)

    def __getitem__(self, k: int) -> SFTSample:
        if not 0 <= k < len(self):
            raise IndexError(f"window {k} is outside the {len(self)} of {self.dataset.prefix}")
        first = k * self.seq_length
        window = self.tokens(first, min(first + self.seq_length + ADD_EXTRA_TOKEN, self.num_tokens))
        scored = len(window) - 1
        inputs = np.zeros(self.seq_length, dtype=np.int64)
        labels = np.full(self.seq_length, IGNORE_INDEX, dtype=np.int64)
        inputs[:scored], labels[:scored] = window[:-1], window[1:]
        positions = np.arange(self.seq_length, dtype=np.int64)
        segments = np.zeros(self.seq_length, dtype=np.int64)
        if (
            self.documents is not None
        ):  # (as training read the documents: --reset-*, --eod-mask-loss, document attention)
            marked, reset, numbered = document_arrays(inputs[None], labels[None], self.documents)
            labels = marked[0]
            positions = reset[0] if reset is not None else positions
            segments = numbered[0] if numbered is not None else segments
        return SFTSample(inputs, labels, positions, segments)
