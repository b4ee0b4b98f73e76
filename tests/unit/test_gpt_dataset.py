"""GPT samples and blends: equal to megatron-core's for the same data, seed and counts; their
properties; caching; the loader's data-parallel slices and resume order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paratron.data.blending import BlendedDataset, blending_indices, component_sizes, parse_blend
from paratron.data.gpt_dataset import GPTDataset, build_sample_indices
from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter
from paratron.errors import ConfigError


def write_dataset(prefix: Path, n_docs: int, seed: int = 0, vocab: int = 1000) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(n_docs):
            writer.add_document(rng.integers(1, vocab, size=int(rng.integers(1, 40))))
    return IndexedDataset(prefix)


def build_once(path: Path, build) -> None:
    if not path.exists():
        build(path)


class _Tokenizer:
    vocab_size, eod, pad = 1000, 0, 0
    unique_identifiers = {"class": "test"}


def megatron_gpt_dataset(prefix: Path, documents: np.ndarray, seq_length: int, num_samples: int, seed: int):
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPT
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.utils import Split

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([str(prefix)], None),
        split="1,0,0",
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
    )
    return MegatronGPT(MegatronIndexed(str(prefix)), str(prefix), documents, num_samples, Split.train, config)


@pytest.mark.parametrize(
    "n_docs, documents, seq_length, num_samples, seed",
    [
        (300, (0, 300), 16, 50, 1234),  # under one epoch
        (300, (0, 290), 32, 900, 7),  # several epochs, the last one mostly used: shuffled with the rest
        (300, (10, 200), 8, 2000, 3),  # several epochs, a thin last one: shuffled on its own
        (50, (0, 50), 64, 40, 0),  # samples longer than documents
    ],
)
def test_indices_and_samples_equal_megatron_core(tmp_path, n_docs, documents, seq_length, num_samples, seed):
    prefix = tmp_path / "d"
    ds = write_dataset(prefix, n_docs, seed)
    docs = np.arange(*documents, dtype=np.int32)
    ours = build_sample_indices(ds.sequence_lengths, docs, seq_length, num_samples, seed)
    theirs = megatron_gpt_dataset(prefix, docs, seq_length, num_samples, seed)
    np.testing.assert_array_equal(ours[0], theirs.document_index)
    np.testing.assert_array_equal(ours[1], theirs.sample_index)
    np.testing.assert_array_equal(ours[2], theirs.shuffle_index)
    dataset = GPTDataset(ds, docs, seq_length, num_samples, seed, tmp_path / "cache", build_once)
    assert len(dataset) == len(theirs) >= num_samples
    for k in list(range(10)) + [len(dataset) - 1]:
        np.testing.assert_array_equal(
            dataset[k], theirs[k]["tokens"].numpy().tolist() + [theirs[k]["labels"][-1].item()]
        )


def test_every_token_of_the_split_is_used_once_per_epoch_and_none_outside(tmp_path):
    ds = write_dataset(tmp_path / "d", 120)
    docs = np.arange(20, 100, dtype=np.int32)  # a middle split: documents 20..99
    seq = 10
    document_index, sample_index, shuffle_index = build_sample_indices(ds.sequence_lengths, docs, seq, 500, 5)
    tokens_per_epoch = int(ds.sequence_lengths[docs].sum())
    epochs = len(document_index) // len(docs)
    assert epochs * tokens_per_epoch >= 500 * seq + 1 > (epochs - 1) * tokens_per_epoch
    assert sorted(np.bincount(document_index, minlength=120)[docs]) == [epochs] * len(docs)  # each doc once per epoch
    assert set(document_index.tolist()) <= set(docs.tolist())  # never a document of another split
    # consecutive samples tile the stream: each starts where the previous one's extra token is
    stream = np.concatenate([ds[int(d)] for d in document_index])
    positions = [sum(int(ds.sequence_lengths[document_index[j]]) for j in range(p)) + o for p, o in sample_index]
    assert positions == [k * seq for k in range(len(sample_index))]
    assert sorted(shuffle_index.tolist()) == list(range(len(sample_index) - 1))
    dataset = GPTDataset(ds, docs, seq, 500, 5, tmp_path / "c", build_once)
    i = int(shuffle_index[3])
    np.testing.assert_array_equal(dataset[3], stream[i * seq : i * seq + seq + 1])


def test_index_is_cached_under_a_hash_and_rebuilt_when_inputs_change(tmp_path):
    ds = write_dataset(tmp_path / "d", 100)
    docs = np.arange(100, dtype=np.int32)
    built: list[Path] = []

    def recording_build_once(path: Path, build) -> None:
        if not path.exists():
            built.append(path)
            build(path)

    GPTDataset(ds, docs, 16, 100, 1, tmp_path / "cache", recording_build_once)
    GPTDataset(ds, docs, 16, 100, 1, tmp_path / "cache", recording_build_once)
    assert len(built) == 1 and (built[0] / "description.json").is_file()
    for change in (dict(seq_length=8), dict(num_samples=200), dict(seed=2)):
        kwargs = dict(seq_length=16, num_samples=100, seed=1) | change
        GPTDataset(
            ds,
            docs,
            kwargs["seq_length"],
            kwargs["num_samples"],
            kwargs["seed"],
            tmp_path / "cache",
            recording_build_once,
        )
        assert built[-1] != built[0]  # a folder of its own
    assert len(built) == 4


def test_blending_indices_equal_megatron_core_and_hold_the_weights():
    from megatron.core.datasets import helpers

    weights, size = [0.3, 0.2, 0.5], 20_000
    dataset_index, sample_index = blending_indices(weights, size)
    theirs_index = np.zeros(size, dtype=np.int16)
    theirs_sample = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(theirs_index, theirs_sample, np.array(weights), 3, size, False)
    np.testing.assert_array_equal(dataset_index, theirs_index)
    np.testing.assert_array_equal(sample_index, theirs_sample)
    counts = np.stack([np.cumsum(dataset_index == d) for d in range(3)], axis=1)
    prefix = np.arange(1, size + 1)[:, None]
    shares = counts[1000:] / prefix[1000:]
    assert np.abs(shares - np.array(weights)).max() < 0.01  # within 1% at every prefix past 1,000 samples
    assert np.abs(shares - np.array(weights)).max() < 1.5 / 1000  # in fact within about one sample
    assert component_sizes(weights, size) == [6030, 4020, 10050]


def test_blended_dataset_draws_from_its_parts(tmp_path):
    a, b = write_dataset(tmp_path / "a", 60, seed=1), write_dataset(tmp_path / "b", 60, seed=2)
    docs = np.arange(60, dtype=np.int32)
    parts = [
        GPTDataset(ds, docs, 8, n, 0, tmp_path / "c", build_once)
        for ds, n in zip((a, b), component_sizes([0.25, 0.75], 400))
    ]
    blend = BlendedDataset(parts, [0.25, 0.75], 400, tmp_path / "c", build_once, ["a", "b"])
    assert len(blend) == 400
    k = int(np.flatnonzero(np.asarray(blend.dataset_index) == 1)[5])
    np.testing.assert_array_equal(blend[k], parts[1][int(blend.dataset_sample_index[k])])


def test_parse_blend():
    weighted = parse_blend(["0.3", "A", "0.7", "~/B"])
    assert weighted.paths == ["A", str(Path("~/B").expanduser())] and weighted.weights == pytest.approx([0.3, 0.7])
    assert parse_blend(["A", "B"]).weights is None and parse_blend(["A"]).paths == ["A"]
    with pytest.raises(ConfigError, match="expected PREFIX..., or WEIGHT PREFIX pairs"):
        parse_blend(["0.3", "A", "B"])
    with pytest.raises(ConfigError, match="weights must be positive"):
        parse_blend(["0", "A", "1", "B"])
