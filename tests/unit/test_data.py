"""Data: tokenizer round trips, sample windows, order as a pure function of the seed, DP slices."""

from __future__ import annotations

import numpy as np
import pytest

from paratron.config import build_config
from paratron.data.build import build_data
from paratron.data.corpus import read_text, stdlib_files, text_files
from paratron.data.datasets import MockTokens, ShuffledSamples, TokenWindows
from paratron.data.loader import BatchPlan
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.errors import DataError

TEXTS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "print('héllo wörld')\n", "数据并行与张量并行\n"] * 20


def test_byte_level_bpe_round_trips_any_utf8():
    tokenizer = train_byte_level_bpe(iter(TEXTS), vocab_size=300)
    assert tokenizer.vocab_size <= 300
    for text in TEXTS[:4] + ["emoji 🚀 and unseen 漢字 and tabs\t\r\n", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([tokenizer.eod_id]) == "<|endoftext|>"


def test_stdlib_corpus_is_found_and_ordered():
    files = stdlib_files()
    assert len(files) > 300
    assert any(f.name == "argparse.py" for f in files)
    assert not any({"site-packages", "test"} & set(f.parts) for f in files)
    assert files == stdlib_files()


def test_token_windows_overlap_by_one_and_span_documents():
    tokens = np.arange(23, dtype=np.uint16)
    windows = TokenWindows(tokens, seq_length=5)
    assert len(windows) == 4  # (23 - 1) // 5
    assert windows[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert windows[1].tolist() == [5, 6, 7, 8, 9, 10]
    assert windows[3].dtype == np.int64


def test_shuffled_order_is_a_pure_function_of_seed_and_index():
    source = TokenWindows(np.arange(1001), seq_length=10)  # 100 samples
    a, b, c = ShuffledSamples(source, 1), ShuffledSamples(source, 1), ShuffledSamples(source, 2)
    epoch0 = [int(a[k][0]) // 10 for k in range(100)]
    assert sorted(epoch0) == list(range(100))  # each sample once per epoch
    epoch1 = [int(a[k][0]) // 10 for k in range(100, 200)]
    assert sorted(epoch1) == list(range(100)) and epoch1 != epoch0  # reshuffled next epoch
    assert all(np.array_equal(a[k], b[k]) for k in (0, 57, 150, 10_000))
    assert [int(c[k][0]) for k in range(100)] != [int(a[k][0]) for k in range(100)]


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


def test_text_corpus_build_split_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc{i:02d}.py").write_text(TEXTS[i % 4] * 30)
    (corpus / ".hidden").write_text("ignored")
    config = build_config(dict(data_path=[str(corpus)], vocab_size=320, seq_length=16, split="90,10,0"))
    logs: list[str] = []
    bundle = build_data(config, log=logs.append)
    assert any("tokenizer-bpe320" in line for line in logs) and any("corpus-" in line for line in logs)
    assert bundle.tokenizer is not None and bundle.vocab_size == 320
    assert len(bundle.train) > 5 * len(bundle.valid) > 0  # 36 documents against 4
    logs.clear()
    again = build_data(config, log=logs.append)
    assert logs == []  # cached
    assert np.array_equal(again.train[5], bundle.train[5])
    assert sorted(p.name for p in text_files([str(corpus)]))[:2] == ["doc00.py", "doc01.py"]


def test_bad_text_is_reported_with_the_byte_offset(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ok ".encode() + "café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: byte 6 is not valid UTF-8"):
        read_text(bad)
    assert read_text(bad, strict=False).startswith("ok caf")
    with pytest.raises(DataError, match="no such file or directory"):
        text_files([str(tmp_path / "missing")])
