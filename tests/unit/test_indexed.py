"""Megatron's .bin/.idx format: a checked-in pair built by Megatron-LM, bytes rebuilt here from the
format description, our writer and reader against it and against megatron-core itself, bad files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from paratron.errors import DataError

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "megatron_tiny_text_document"  # written by megatron-core 0.16.1's IndexedDatasetBuilder
TINY_DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [65000]]


def expected_idx_bytes(docs: list[list[int]], dtype_code: int, itemsize: int) -> bytes:
    """The .idx of one-sequence-per-document data, straight from the format description."""
    lengths = [len(d) for d in docs]
    pointers = [sum(lengths[:i]) * itemsize for i in range(len(docs))]
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1)
    out += struct.pack(f"<{len(docs)}i", *lengths) + struct.pack(f"<{len(docs)}q", *pointers)
    out += struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1))
    return out


def test_checked_in_megatron_pair_matches_the_format_description():
    assert TINY.with_suffix(".idx").read_bytes() == expected_idx_bytes(TINY_DOCS, dtype_code=8, itemsize=2)
    assert TINY.with_suffix(".bin").read_bytes() == struct.pack("<10H", *[t for d in TINY_DOCS for t in d])


def test_reader_reads_megatrons_file():
    ds = IndexedDataset(TINY)
    assert len(ds) == 4 and ds.num_documents == 4 and ds.num_tokens == 10 and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(4)] == TINY_DOCS
    assert ds[-1].tolist() == [65000]
    assert ds.get(2, offset=1, length=2).tolist() == [7, 8]
    assert ds.get(2, offset=3).tolist() == [9]
    assert [d.tolist() for d in ds[1:3]] == TINY_DOCS[1:3]
    for bad in (
        lambda: ds[4],
        lambda: ds.get(1, offset=1, length=5),
        lambda: ds.get(2, offset=6),
        lambda: ds.get(2, offset=1, length=-1),
    ):
        with pytest.raises(IndexError):
            bad()


def test_writer_reproduces_megatrons_bytes(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as writer:
        writer.add_document(TINY_DOCS[0])
        writer.add_documents(np.array([4, 5, 6, 7, 8, 9]), np.array([2, 4]))
        writer.add_document(np.array([65000]))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == TINY.with_suffix(suffix).read_bytes()


def test_round_trip_with_megatron_core_both_ways(tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100_000, size=int(rng.integers(1, 50))) for _ in range(200)]
    with IndexedDatasetWriter(tmp_path / "ours", np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
    theirs = MegatronDataset(str(tmp_path / "ours"))
    assert len(theirs) == 200 and all(np.array_equal(theirs[i], d) for i, d in enumerate(docs))
    assert np.array_equal(theirs.document_indices, np.arange(201))

    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), dtype=np.int32)
    for doc in docs:
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(str(tmp_path / "megatron.idx"))
    ours = IndexedDataset(tmp_path / "megatron")
    assert all(np.array_equal(ours[i], d) for i, d in enumerate(docs))
    assert (tmp_path / "megatron.idx").read_bytes() == (tmp_path / "ours.idx").read_bytes()


def test_dtype_choice_follows_megatron():
    assert optimal_dtype(50257) is np.uint16 and optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32 and optimal_dtype(128256) is np.int32 and optimal_dtype(None) is np.int32


def test_values_that_do_not_fit_are_refused(tmp_path):
    with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:
        with pytest.raises(ValueError, match=r"token ids 0..70000 do not fit uint16"):
            writer.add_document([0, 70000])
        writer.add_document([1])


def test_interrupted_write_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(tmp_path / "half", np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def copy_tiny(tmp_path: Path, idx: bytes | None = None, bin_: bytes | None = None) -> Path:
    prefix = tmp_path / "bad"
    prefix.with_suffix(".idx").write_bytes(TINY.with_suffix(".idx").read_bytes() if idx is None else idx)
    prefix.with_suffix(".bin").write_bytes(TINY.with_suffix(".bin").read_bytes() if bin_ is None else bin_)
    return prefix


def test_bad_files_are_reported_with_file_and_offset(tmp_path):
    good = TINY.with_suffix(".idx").read_bytes()
    cases = [
        (dict(idx=b"NOTANIDX" + good[8:]), r"bad.idx: bytes 0-8 are .*not the MMIDIDX magic"),
        (dict(idx=good[:30]), r"bad.idx: truncated at byte 30 inside the 34-byte header"),
        (dict(idx=good[:100]), r"bad.idx: truncated: 100 bytes, but its header promises 122"),
        (dict(idx=good[:9] + struct.pack("<Q", 2) + good[17:]), r"bad.idx: version 2 at byte 9 is not supported"),
        (dict(idx=good[:17] + b"\x09" + good[18:]), r"bad.idx: dtype code 9 at byte 17 is unknown"),
        (
            dict(bin_=TINY.with_suffix(".bin").read_bytes()[:14]),
            r"bad.bin: 14 bytes, shorter than its index says \(20 bytes, to the end of sequence 3\)",
        ),
        (dict(bin_=TINY.with_suffix(".bin").read_bytes()[:15]), r"bad.bin: 15 bytes is not a whole number of uint16"),
    ]
    for kwargs, message in cases:
        with pytest.raises(DataError, match=message):
            IndexedDataset(copy_tiny(tmp_path, **kwargs))
    with pytest.raises(DataError, match=r"missing.idx: no such file"):
        IndexedDataset(tmp_path / "missing")
