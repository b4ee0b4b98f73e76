"""Megatron-LM's memory-mapped indexed dataset: PREFIX.bin (tokens) and PREFIX.idx (index).

The .idx file, all little-endian:

    offset 0    9 bytes   magic b"MMIDIDX\\x00\\x00"
    offset 9    uint64    version, 1
    offset 17   uint8     dtype code of the tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                          6 float64, 7 float32, 8 uint16)
    offset 18   uint64    S, the number of sequences
    offset 26   uint64    D, the number of document-index entries (documents + 1)
    offset 34   int32[S]  sequence lengths, in tokens
                int64[S]  sequence pointers, byte offsets into .bin
                int64[D]  document index: document d is sequences [doc[d], doc[d+1])

The .bin file is the tokens of all sequences, back to back. paratron writes one sequence
per document, as Megatron's preprocessing does without sentence splitting. Files written
here load with Megatron-LM's reader and the other way round (tests/unit/test_indexed.py).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from paratron.errors import DataError, UserError
from paratron.storage import replacing, space_at, temporary_beside, writing

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}
OUTPUT_FIX = "free space or choose another --output-prefix"


def optimal_dtype(vocab_size: int | None) -> type:
    """Megatron's choice: uint16 when every id fits (vocabulary under 65,500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dataset_exists(prefix: str | Path) -> bool:
    return Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file()


class IndexedDatasetWriter:
    """Streams documents into PREFIX.bin and writes PREFIX.idx at `finalize`.

    Both are written under temporary names and renamed into place at the end (.bin first,
    then .idx), so an interrupted write never leaves a dataset that looks complete. Memory
    holds only the per-document lengths. A full disk deletes the temporary files and ends in one
    line (`UserError`) with `expected_bytes`, the caller's estimate of the whole, when it has one.
    """

    def __init__(self, prefix: str | Path, dtype: type, fix: str = OUTPUT_FIX) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"dtype {self.dtype} has no Megatron code")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self.fix = fix
        self.expected_bytes: int | None = None
        """The finished .bin and .idx, as the caller estimates them (a full disk's line shows it)."""
        self._space = space_at(Path(self.prefix).parent)
        self._bin_tmp = temporary_beside(Path(f"{self.prefix}.bin"))
        self._bin = open(self._bin_tmp, "wb")
        self.lengths = array("i")  # int32, like Megatron

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A full disk in one line, after the temporary files are deleted."""
        where = Path(f"{self.prefix}.bin")
        try:
            with writing("the indexed dataset", where, lambda: self.expected_bytes, self.fix, space=self._space):
                yield
        except UserError:
            self.abort()
            raise

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        tokens = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
        self.add_documents(tokens, np.array([len(tokens)]))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many documents at once: their tokens concatenated, and each one's length."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        if tokens.size and np.issubdtype(self.dtype, np.integer):
            limits = np.iinfo(self.dtype)
            if tokens.min() < limits.min or tokens.max() > limits.max:
                raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {self.dtype}")
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a document longer than 2**31 - 1 tokens does not fit the index")
        with self._writing():
            self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.lengths.extend(lengths.astype(np.int32).tolist())

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    def finalize(self) -> None:
        with self._writing():
            self._finalize()

    def _finalize(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self.lengths, dtype=np.int32) if self.lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        with replacing(Path(f"{self.prefix}.idx")) as idx_tmp:
            with open(idx_tmp, "wb") as f:
                f.write(MAGIC)
                f.write(struct.pack("<Q", VERSION))
                f.write(struct.pack("<B", CODES[self.dtype]))
                f.write(struct.pack("<Q", len(lengths)))
                f.write(struct.pack("<Q", len(documents)))
                f.write(lengths.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(documents.astype("<i8").tobytes())
            # An old index never sits beside the new tokens: drop it before the new .bin lands.
            Path(f"{self.prefix}.idx").unlink(missing_ok=True)
            self._bin_tmp.replace(f"{self.prefix}.bin")

    def abort(self) -> None:
        """Close and delete the temporary files (after an error or an interruption)."""
        try:
            self._bin.close()
        except OSError:  # (what was left in its buffer did not fit: it is closed all the same)
            pass
        self._bin_tmp.unlink(missing_ok=True)  # (the index's is removed where it is written)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """A view of PREFIX.bin/.idx. `ds[i]` is sequence i as a NumPy array; `ds.get(i, offset, length)`
    reads part of it without touching the rest. The index is memory-mapped; the tokens are too
    unless `mmap_bin` is False (Megatron's --no-mmap-bin-files), then each read is a file read."""

    def __init__(self, prefix: str | Path, mmap_bin: bool = True) -> None:
        self.prefix = str(prefix)
        self.mmap_bin = mmap_bin
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DataError(f"{path}: no such file; --data-path takes the prefix of a .bin/.idx pair")
        self._read_index(idx_path)
        needed = (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if len(self.sequence_lengths)
            else 0
        )
        size = bin_path.stat().st_size
        if size % self.dtype.itemsize:
            raise DataError(
                f"{bin_path}: {size} bytes is not a whole number of {self.dtype} tokens; the file is damaged"
            )
        if size < needed:
            last = len(self.sequence_lengths) - 1
            raise DataError(
                f"{bin_path}: {size} bytes, shorter than its index says ({needed} bytes, to the end "
                f"of sequence {last}); the file is truncated"
            )
        self.bin_path = bin_path
        self.bin = np.memmap(bin_path, dtype=self.dtype, mode="r") if size and mmap_bin else np.zeros(0, self.dtype)

    def _read_index(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[:9] != MAGIC:
            raise DataError(
                f"{path}: bytes 0-8 are {header[:9]!r}, not the MMIDIDX magic; not a Megatron indexed dataset index"
            )
        if len(header) < HEADER_BYTES:
            raise DataError(f"{path}: truncated at byte {len(header)} inside the {HEADER_BYTES}-byte header")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise DataError(f"{path}: version {version} at byte 9 is not supported (expected {VERSION})")
        code = header[17]
        if code not in DTYPES:
            raise DataError(f"{path}: dtype code {code} at byte 17 is unknown (expected 1-8)")
        self.dtype = np.dtype(DTYPES[code])
        sequences, documents = struct.unpack("<QQ", header[18:34])
        expected = HEADER_BYTES + sequences * 12 + documents * 8
        if size < expected:
            raise DataError(
                f"{path}: truncated: {size} bytes, but its header promises {expected} "
                f"({sequences} sequences, {documents} document entries)"
            )
        index = np.memmap(path, mode="r", dtype=np.uint8, offset=0)
        start = HEADER_BYTES
        self.sequence_lengths = index[start : start + 4 * sequences].view("<i4")
        start += 4 * sequences
        self.sequence_pointers = index[start : start + 8 * sequences].view("<i8")
        start += 8 * sequences
        self.document_indices = index[start : start + 8 * documents].view("<i8")
        if sequences and (self.sequence_lengths.min() < 0 or np.any(np.diff(self.sequence_pointers) < 0)):
            raise DataError(f"{path}: negative lengths or decreasing pointers; the index is corrupt")
        docs = self.document_indices
        if documents and (docs[0] != 0 or docs[-1] != sequences or np.any(np.diff(docs) < 0)):
            raise DataError(
                f"{path}: the document index (from byte {HEADER_BYTES + 12 * sequences}) does not "
                f"run from 0 to {sequences} in order; the index is corrupt"
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return max(0, len(self.document_indices) - 1)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {index} of length {size}")
        if not self.mmap_bin:
            if length == 0:
                return np.zeros(0, self.dtype)
            start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
            return np.fromfile(self.bin_path, dtype=self.dtype, count=length, offset=start)
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return np.asarray(self.bin[start : start + length])

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        """Sequence `index`, or a list of them for a slice (as Megatron's reader)."""
        if isinstance(index, slice):
            return [self.get(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} is outside the dataset of {len(self)}")
        return self.get(index)
