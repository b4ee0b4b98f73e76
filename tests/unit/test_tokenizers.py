"""Tokenizers by Megatron type name: trained byte-level BPE, tokenizer.json, GPT-2 files, NullTokenizer."""

from __future__ import annotations

import pytest

from paratron.data.tokenizer import NullTokenizer, Tokenizer, load_tokenizer, tokenizer_from_spec, train_byte_level_bpe
from paratron.errors import DataError

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "class A:\n    pass\n",
    "print('héllo wörld')\n",
    "数据并行与张量并行，流水线并行。\n",
] * 20
HARD = TEXTS[:4] + ["emoji 🚀, unseen 漢字かな, tabs\t\r\n", "", "   leading spaces", "<|endoftext|> inside"]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_byte_level_bpe(iter(TEXTS), vocab_size=300)


def test_trained_bpe_round_trips_any_utf8(bpe):
    assert bpe.vocab_size <= 300
    for text in HARD:
        assert bpe.decode(bpe.encode(text)) == text
    assert bpe.decode([bpe.eod_id]) == "<|endoftext|>" and bpe.pad_id == bpe.eod_id
    assert len(bpe.encode("数据并行")) < len("数据并行".encode())  # merges learned for Chinese too


def test_tokenizer_json_and_its_folder(bpe, tmp_path):
    bpe.save(tmp_path / "tokenizer.json")
    for source in (tmp_path / "tokenizer.json", tmp_path):
        loaded = load_tokenizer("HuggingFaceTokenizer", str(source))
        assert [loaded.encode(t) for t in HARD] == [bpe.encode(t) for t in HARD]
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="broken.json: not a readable tokenizer.json"):
        Tokenizer.from_file(tmp_path / "broken.json")


def test_gpt2_vocab_and_merge_files(bpe, tmp_path):
    vocab, merges = bpe.hf.model.save(str(tmp_path))  # GPT-2's vocab.json + merges.txt layout
    gpt2 = load_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    for text in HARD[:-1]:
        assert gpt2.encode(text) == bpe.encode(text)
        assert gpt2.decode(gpt2.encode(text)) == text
    assert gpt2.eod_id == bpe.eod_id
    # as in Megatron's GPT-2 tokenizer, the literal text is ordinary characters, not the EOD id
    literal = gpt2.encode("<|endoftext|>")
    assert gpt2.eod_id not in literal and len(literal) > 1 and gpt2.decode(literal) == "<|endoftext|>"
    with pytest.raises(DataError, match="GPT2BPETokenizer needs --vocab-file and --merge-file"):
        load_tokenizer("GPT2BPETokenizer", vocab_file=vocab)


def test_null_tokenizer_is_megatrons():
    null = load_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(null, NullTokenizer)
    assert null.encode("5 17  99\n3") == [5, 17, 99, 3]
    assert null.decode([5, 17]) == "5 17"
    assert null.eod_id == 100 and null.vocab_size == 101  # eod is one past the ids, as in Megatron
    with pytest.raises(ValueError, match=r"outside \[0, 100\)"):
        null.encode("100")
    with pytest.raises(ValueError, match="expects token ids"):
        null.encode("five")
    with pytest.raises(DataError, match="NullTokenizer needs --vocab-size"):
        load_tokenizer("NullTokenizer")


def test_specs_rebuild_the_same_tokenizer_in_another_process(bpe):
    for tokenizer in (bpe, NullTokenizer(50)):
        again = tokenizer_from_spec(tokenizer.spec())
        assert again.encode(TEXTS[0] if tokenizer is bpe else "1 2 3") == tokenizer.encode(
            TEXTS[0] if tokenizer is bpe else "1 2 3"
        )
        assert again.eod_id == tokenizer.eod_id
