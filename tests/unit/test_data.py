"""Building a run's data from its config: corpora, caches, splits, blends, per-split paths, order."""

from __future__ import annotations

import numpy as np
import pytest

from paratron.config import build_config, validate
from paratron.config.layout import BatchPlan
from paratron.data.blending import BlendedDataset
from paratron.data.build import build_data
from paratron.data.corpus import stdlib_files
from paratron.data.datasets import MockTokens
from paratron.data.gpt_dataset import GPTDataset
from paratron.data.preprocess import input_files, preprocess
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.errors import ConfigError, DataError
from paratron.training.preflight.data_files import check_data_inputs

TEXTS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "print('héllo wörld')\n", "数据并行与张量并行\n"]


def checked(config) -> None:
    """What runs before any worker starts: the settings, then the files they name."""
    validate(config, 1)
    check_data_inputs(config)


def test_stdlib_corpus_is_found_and_ordered():
    files = stdlib_files()
    assert len(files) > 300
    assert any(f.name == "argparse.py" for f in files)
    assert not any({"site-packages", "test"} & set(f.parts) for f in files)
    assert files == stdlib_files()


def test_mock_samples_are_deterministic_progressions():
    mock = MockTokens(vocab_size=50, seq_length=8, seed=3)
    s = mock[12]
    assert np.array_equal(s, MockTokens(50, 8, 3)[12]) and len(s) == 9
    steps = np.diff(s) % 50
    assert len(set(steps.tolist())) == 1 and 1 <= steps[0] < 8


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_data_parallel_ranks_split_every_global_batch(dp):
    single = BatchPlan(global_batch_size=16, micro_batch_size=2, dp_size=1, dp_rank=0)
    ranks = [BatchPlan(16, 2, dp, r) for r in range(dp)]
    assert single.num_micro_batches == 8 and ranks[0].num_micro_batches == 8 // dp
    for consumed in (0, 16, 160):
        union = sorted(i for plan in ranks for mb in plan.sample_indices(consumed) for i in mb)
        assert union == list(range(consumed, consumed + 16))
        # micro-batch m of rank r is the r-th block of the m-th chunk of mbs x dp samples
        assert ranks[-1].sample_indices(consumed)[0] == [consumed + 2 * (dp - 1), consumed + 2 * (dp - 1) + 1]


def make_corpus(path, n_docs=40, repeat=30):
    path.mkdir()
    for i in range(n_docs):
        (path / f"doc{i:02d}.py").write_text(TEXTS[i % 4] * repeat + f"# {i}\n")
    return path


def test_text_directory_is_preprocessed_split_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache"))
    corpus = make_corpus(tmp_path / "corpus")
    config = build_config(
        dict(
            data_path=[str(corpus)],
            vocab_size=320,
            seq_length=16,
            split="90,10,0",
            train_iters=20,
            eval_interval=10,
            eval_iters=2,
        )
    )
    checked(config)
    logs: list[str] = []
    bundle = build_data(config, global_batch_size=4, log=logs.append)
    assert [line.split("/")[-1].split("-")[0] for line in logs] == ["tokenizer", "corpus", "gpt", "gpt"]
    assert bundle.tokenizer is not None and bundle.vocab_size == 320
    train, valid = bundle.train, bundle.valid
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset)
    assert set(np.asarray(train.document_index).tolist()) == set(range(36))  # 90% of 40 documents
    assert set(np.asarray(valid.document_index).tolist()) == set(range(36, 40))
    assert len(train) >= 20 * 4 and len(valid) >= (20 // 10 + 1) * 2 * 4
    text = bundle.tokenizer.decode(train[0])
    assert len(train[0]) == 17 and any(t[:6] in text for t in TEXTS)
    logs.clear()
    again = build_data(config, global_batch_size=4, log=logs.append)
    assert logs == []  # everything came from the cache
    assert all(np.array_equal(again.train[k], train[k]) for k in (0, 5, 79))


def test_weighted_blend_of_preprocessed_prefixes(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache"))
    tokenizer = train_byte_level_bpe(iter(TEXTS * 10), vocab_size=300)
    tokenizer.save(tmp_path / "tokenizer.json")
    prefixes = []
    for name, n in (("a", 30), ("b", 50)):
        files = input_files([str(make_corpus(tmp_path / name, n_docs=n))])
        prefixes.append(preprocess(files, str(tmp_path / name), tokenizer, append_eod=True, progress=False).prefixes[0])
    config = build_config(
        dict(
            data_path=["0.3", prefixes[0], "0.7", prefixes[1]],
            seq_length=16,
            train_iters=1000,
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(tmp_path / "tokenizer.json"),
            eval_iters=1,
            eval_interval=500,
        )
    )
    checked(config)
    bundle = build_data(config, global_batch_size=4, log=lambda _: None)
    assert isinstance(bundle.train, BlendedDataset) and len(bundle.train) == 4000
    shares = np.bincount(np.asarray(bundle.train.dataset_index), minlength=2) / 4000
    assert shares == pytest.approx([0.3, 0.7], abs=0.001)
    assert bundle.vocab_size == tokenizer.vocab_size

    per_split = build_config(
        dict(
            train_data_path=[prefixes[1]],
            valid_data_path=[prefixes[0]],
            seq_length=16,
            train_iters=10,
            eval_iters=1,
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(tmp_path / "tokenizer.json"),
        )
    )
    checked(per_split)
    bundle = build_data(per_split, global_batch_size=4, log=lambda _: None)
    assert set(np.asarray(bundle.train.document_index).tolist()) == set(range(50))  # all of b, no --split
    assert set(np.asarray(bundle.valid.document_index).tolist()) == set(range(30))  # all of a

    with pytest.raises(ConfigError, match=r"ByteLevelBPE trains on text, but \(some of\) the data is preprocessed"):
        checked(build_config(dict(data_path=[prefixes[0]])))
    with pytest.raises(ConfigError, match="--eval-iters 100 needs --valid-data-path"):  # (Megatron-LM's default)
        checked(build_config(dict(train_data_path=[prefixes[0]], tokenizer_type="NullTokenizer", vocab_size=9)))
    with pytest.raises(ConfigError, match=r"--data-path /nope: neither a dataset prefix \(/nope.bin/.idx\)"):
        checked(build_config(dict(data_path=["/nope"])))


def test_unweighted_blend_weighs_by_length_and_null_tokenizer_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache"))
    from paratron.data.tokenizer import NullTokenizer
    from paratron.training.run import run_training

    prefixes = []
    for name, n in (("a", 20), ("b", 60)):
        files = [tmp_path / f"{name}.jsonl"]
        files[0].write_text(
            "".join(f'{{"text": "{" ".join(str((i * 7 + j) % 50) for j in range(40))}"}}\n' for i in range(n))
        )
        prefixes.append(
            preprocess(files, str(tmp_path / name), NullTokenizer(50), append_eod=True, progress=False).prefixes[0]
        )
    config = build_config(
        dict(
            data_path=prefixes,
            tokenizer_type="NullTokenizer",
            vocab_size=50,
            seq_length=8,
            train_iters=5,
            eval_iters=0,
            micro_batch_size=2,
            split="1,0,0",
        )
    )
    checked(config)
    bundle = build_data(config, global_batch_size=2, log=lambda _: None)
    assert bundle.vocab_size == 51  # the ids and the end-of-document id
    assert isinstance(bundle.train, BlendedDataset) and len(bundle.train) == 10  # min(needed, one epoch)
    lengths = [len(ds) for ds in bundle.train.datasets]  # one epoch each
    assert bundle.train.weights == pytest.approx([lengths[0] / sum(lengths), lengths[1] / sum(lengths)])
    assert lengths[1] > 2 * lengths[0]  # b holds three times a's documents
    too_many = build_config(
        dict(
            config_dict := dict(
                data_path=prefixes,
                tokenizer_type="NullTokenizer",
                vocab_size=50,
                seq_length=8,
                eval_iters=0,
                split="1,0,0",
            ),
            train_iters=100_000,
        )
    )
    with pytest.raises(DataError, match=r"holds \d+ samples in one epoch but 200000 are needed"):
        build_data(too_many, global_batch_size=2, log=lambda _: None)
    losses = run_training(
        build_config(
            dict(
                config_dict,
                train_iters=5,
                micro_batch_size=2,
                run_dir=str(tmp_path / "r"),
                progress_bar=False,
                tensorboard=False,
                log_interval=1,
            )
        )
    ).losses
    assert len(losses) == 5 and all(np.isfinite(losses))


def test_split_boundaries_equal_megatron_core():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from paratron.data.blending import split_ranges

    for split in ("969,30,1", "99,1,0", "1,1,1", "80,20", "100", "90,5,5"):
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for n in (1, 7, 99, 1000, 4097):
            ours = split_ranges(n, split)
            for (lo, hi), part in zip([m or (0, 0) for m in matrix], ours):
                expected = np.arange(int(round(lo * n)), int(round(hi * n)))
                assert np.array_equal(part, expected), (split, n)
