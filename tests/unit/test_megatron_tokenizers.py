"""Megatron-LM's tokenizer and data-loader flags: SentencePiece and tiktoken tokenizers against
megatron-core's own tokenizer library (the oracle), GPT-2 files against transformers, the
--vocab-file/--merge-file implication, --num-workers, --dataloader-type cyclic and --no-mmap-bin-files."""

from __future__ import annotations

import argparse
import base64
import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from paratron.commands.preprocess import add_tokenizer_arguments, tokenizer_from_arguments, tokenizer_type_of
from paratron.config import build_config
from paratron.config.layout import BatchPlan
from paratron.data.build import build_data
from paratron.data.gpt_dataset import GPTDataset
from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter
from paratron.data.loader import DocumentLayout, LoaderSource, cyclic_sample_indices, micro_batches
from paratron.data.preprocess import preprocess
from paratron.data.tokenizer import load_tokenizer, tokenizer_for, tokenizer_from_spec, train_byte_level_bpe
from paratron.errors import ConfigError, DataError
from paratron.training.preflight.data_files import check_data_inputs
from paratron.training.run import run_training

from tiny import tiny_config

LINES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, héllo wörld",
    "数据并行与张量并行",
    "pack my box with five dozen liquor jugs",
] * 20
TEXTS = ["hello the fox", "  leading spaces and\ttabs\n", "héllo 数据 wörld!", "a </s> inside <s> text", ""]


def megatron_tokenizer(path: Path, library: str, **kwargs):
    """megatron-core's tokenizer library (what Megatron-LM uses unless --legacy-tokenizer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers import MegatronTokenizer  # (slow import: only the tests that compare)

    return MegatronTokenizer.from_pretrained(tokenizer_path=str(path), metadata_path={"library": library}, **kwargs)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES), model_writer=model, vocab_size=80, model_type="bpe", minloglevel=2
    )
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def tiktoken_vocab(tmp_path_factory) -> Path:
    """Megatron's tiktoken JSON: the 256 bytes, then merges (each made of earlier entries)."""
    merges = [b"th", b"he", b"the", b" t", b" the", b"in", b"er", b"lo", b"llo", b"hello", b" f", b"ox", b"\xc3\xa9"]
    tokens = [bytes([i]) for i in range(256)] + merges
    entries = [
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
        for i, t in enumerate(tokens)
    ]
    path = tmp_path_factory.mktemp("tiktoken") / "vocab.json"
    path.write_text(json.dumps(entries))
    return path


def test_sentencepiece_tokenizers_match_megatron(sp_model):
    oracle = megatron_tokenizer(sp_model, "sentencepiece")
    for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        ours = load_tokenizer(kind, str(sp_model))
        assert [ours.encode(t) for t in TEXTS] == [oracle.tokenize(t) for t in TEXTS]
        assert ours.encode_batch(TEXTS) == [oracle.tokenize(t) for t in TEXTS]
        assert (ours.eod_id, ours.bos_id, ours.vocab_size) == (oracle.eod, oracle.bos, oracle.vocab_size) == (2, 1, 80)
        assert ours.pad_id == ours.eod_id and oracle.pad == -1  # no <pad> piece: paratron pads with eod
        assert ours.decode(ours.encode(TEXTS[0])) == oracle.detokenize(oracle.tokenize(TEXTS[0])) == TEXTS[0]
    # --legacy-tokenizer: Megatron's _Llama2Tokenizer.tokenize starts every document with <s>; GPT's does not
    legacy_llama = load_tokenizer("Llama2Tokenizer", str(sp_model), legacy=True)
    legacy_gpt = load_tokenizer("GPTSentencePieceTokenizer", str(sp_model), legacy=True)
    assert legacy_llama.encode(TEXTS[0]) == [1, *oracle.tokenize(TEXTS[0])]
    assert legacy_gpt.encode(TEXTS[0]) == oracle.tokenize(TEXTS[0])
    again = tokenizer_from_spec(legacy_llama.spec())  # as preprocessing workers rebuild it
    assert again.encode_batch(TEXTS) == legacy_llama.encode_batch(TEXTS)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_matches_megatron(tiktoken_vocab, pattern):
    size = 10 + 256 + 13
    oracle = megatron_tokenizer(
        tiktoken_vocab, "tiktoken", pattern=pattern, vocab_size=size, num_special_tokens=10, special_tokens=None
    )
    ours = load_tokenizer("TikTokenizer", str(tiktoken_vocab), vocab_size=size, tiktoken_pattern=pattern,
                          tiktoken_num_special_tokens=10)  # fmt: skip
    assert [ours.encode(t) for t in TEXTS] == [oracle.tokenize(t) for t in TEXTS]
    assert ours.encode_batch(TEXTS) == [oracle.tokenize(t) for t in TEXTS]
    assert (ours.eod_id, ours.bos_id, ours.pad_id, ours.vocab_size) == (oracle.eod, oracle.bos, oracle.pad, size)
    assert (ours.eod_id, ours.bos_id, ours.pad_id) == (2, 1, 4)  # </s>, <s>, <pad> of the default special tokens
    hello = ours.encode(" hello")
    assert hello == [10 + 32, 10 + 265]  # " " then "hello": the file's ranks shifted by the 10 specials
    assert ours.encode("a </s>")[-1] == 2  # special-token text is its special id
    assert ours.decode(ours.encode(TEXTS[2])) == TEXTS[2]


def test_tiktokenizer_legacy_cut_and_errors(tiktoken_vocab):
    import tiktoken

    legacy = load_tokenizer("TikTokenizer", str(tiktoken_vocab), vocab_size=10 + 256 + 13, legacy=True,
                            tiktoken_pattern="v1", tiktoken_num_special_tokens=10,
                            tiktoken_special_tokens=["<unk>", "<s>", "</s>", "<x>"])  # fmt: skip
    assert legacy.encode("a </s>")[-1] != 2 and legacy.decode(legacy.encode("a </s>")) == "a </s>"  # plain text
    assert (legacy.eod_id, legacy.pad_id, legacy.encoding.encode_single_token("<x>")) == (2, 2, 3)
    cut = load_tokenizer("TikTokenizer", str(tiktoken_vocab), vocab_size=10 + 256 + 3, tiktoken_num_special_tokens=10)
    assert max(max(cut.encode_batch(TEXTS[:3]))) < 10 + 256 + 3  # the vocabulary is cut to --vocab-size
    reference = tiktoken.Encoding(
        "ref", pat_str=cut.encoding._pat_str, mergeable_ranks={bytes([i]): i for i in range(256)}, special_tokens={}
    )
    assert cut.encode("qz") == [i + 10 for i in reference.encode_ordinary("qz")]
    with pytest.raises(DataError, match="needs 130072; give --vocab-size 1269"):
        load_tokenizer("TikTokenizer", str(tiktoken_vocab), tiktoken_num_special_tokens=1000)
    with pytest.raises(DataError, match="must include <unk> <s> </s> <mask> <pad> <cls> <sep>"):
        load_tokenizer("TikTokenizer", str(tiktoken_vocab), vocab_size=279, tiktoken_num_special_tokens=10,
                       tiktoken_special_tokens=["<unk>", "<s>", "</s>"])  # fmt: skip
    with pytest.raises(DataError, match="--legacy-tokenizer with TikTokenizer needs --tiktoken-pattern"):
        load_tokenizer("TikTokenizer", str(tiktoken_vocab), vocab_size=279, legacy=True)


def test_gpt2_files_imply_gpt2bpe_as_megatron(tmp_path):
    from transformers import GPT2Tokenizer

    bpe = train_byte_level_bpe(iter(LINES), vocab_size=300)
    vocab, merges = bpe.hf.model.save(str(tmp_path))
    config = build_config(dict(vocab_file=vocab, merge_file=merges, mock_data=True))
    assert config.data.tokenizer_type is None and config.data.resolved_tokenizer_type == "GPT2BPETokenizer"
    assert build_config(dict(mock_data=True)).data.resolved_tokenizer_type == "ByteLevelBPE"
    ours, oracle = tokenizer_for(config.data, None), GPT2Tokenizer(vocab, merges)
    assert [ours.encode(t) for t in TEXTS] == [oracle.encode(t) for t in TEXTS]
    assert ours.eod_id == oracle.convert_tokens_to_ids("<|endoftext|>") and ours.vocab_size == len(oracle) == 300
    check_data_inputs(config)
    with pytest.raises(ConfigError, match=r"^--vocab-file /nope/vocab.json: no such file \(GPT-2's vocab.json"):
        check_data_inputs(build_config(dict(vocab_file="/nope/vocab.json", merge_file=merges)))
    with pytest.raises(ConfigError, match=r"^GPT2BPETokenizer needs --merge-file"):
        check_data_inputs(build_config(dict(vocab_file=vocab)))
    with pytest.raises(ConfigError, match=r"^--tokenizer-model /nope.model: no such file"):
        check_data_inputs(build_config(dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="/nope.model")))
    with pytest.raises(ConfigError, match="--vocab-extra-ids 100: sentinel tokens are for Megatron-LM's T5"):
        check_data_inputs(build_config(dict(mock_data=True, vocab_extra_ids=100)))
    with pytest.raises(ConfigError, match="--dataloader-type external hands Megatron-LM a loader"):
        check_data_inputs(build_config(dict(mock_data=True, dataloader_type="external")))


def test_preprocess_with_a_sentencepiece_model(sp_model, tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES[:4]))
    tokenizer = load_tokenizer("Llama2Tokenizer", str(sp_model), legacy=True)
    preprocess([tmp_path / "docs.jsonl"], str(tmp_path / "out"), tokenizer, append_eod=True, progress=False)
    dataset = IndexedDataset(tmp_path / "out_text_document")
    assert [list(dataset[i]) for i in range(4)] == [[1, *tokenizer.sp.encode(t), 2] for t in LINES[:4]]


def test_preprocess_takes_the_same_tokenizer_flags(tiktoken_vocab, tmp_path):
    parser = argparse.ArgumentParser()
    add_tokenizer_arguments(parser)
    args = parser.parse_args(["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tiktoken_vocab),
                              "--vocab-size", "279", "--tiktoken-num-special-tokens", "10"])  # fmt: skip
    assert tokenizer_from_arguments(args).encode(" hello") == [42, 275]
    assert tokenizer_type_of(parser.parse_args(["--vocab-file", "v.json"])) == "GPT2BPETokenizer"
    assert tokenizer_type_of(parser.parse_args([])) == "ByteLevelBPE"
    with pytest.raises(DataError, match="--vocab-extra-ids 3: sentinel tokens are for T5/BERT"):
        tokenizer_type_of(parser.parse_args(["--vocab-extra-ids", "3"]))


def _dataset(tmp_path: Path) -> str:
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "tokens")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(40):
            writer.add_document(np.append(rng.integers(1, 50, int(rng.integers(3, 30))), 0))
    return prefix


def test_no_mmap_reads_the_same_tokens(tmp_path):
    prefix = _dataset(tmp_path)
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap_bin=False)
    for i in range(len(mapped)):
        np.testing.assert_array_equal(read[i], mapped[i])
        np.testing.assert_array_equal(read.get(i, 1, 2), mapped.get(i, 1, 2))
    assert read.get(3, 2, 0).size == 0


@pytest.mark.spawns  # (paratron starts the workers)
def test_workers_give_the_same_batches_in_the_same_order(tmp_path):
    prefix = _dataset(tmp_path)
    samples = GPTDataset(IndexedDataset(prefix), np.arange(40, dtype=np.int32), 8, 96, 3, tmp_path / "idx",
                         lambda path, build: path.exists() or build(path))  # fmt: skip
    documents = DocumentLayout(eod_id=0, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    plan = BatchPlan(global_batch_size=8, micro_batch_size=2, dp_size=2, dp_rank=1)
    cpu = torch.device("cpu")
    for kind in ("single", "cyclic"):
        direct = LoaderSource(samples, kind, num_workers=0)
        workers = LoaderSource(samples, kind, num_workers=2)
        for consumed in (0, 8, 16, 40, 8, 16, 88):  # a jump back (a rollback) restarts the workers
            expected = micro_batches(direct, plan, consumed, cpu, documents)
            got = micro_batches(workers, plan, consumed, cpu, documents)
            assert len(got) == len(expected) == 2
            for a, b in zip(got, expected):
                for field in ("input_ids", "labels", "position_ids", "segment_ids"):
                    assert torch.equal(getattr(a, field), getattr(b, field))
        if kind == "single":
            reference = [[samples[i] for i in idx] for idx in plan.sample_indices(16)]
            first = micro_batches(workers, plan, 16, cpu, documents)[0].input_ids
            assert torch.equal(first, torch.from_numpy(np.stack(reference[0])[:, :-1]))


def _cyclic_reference(total: int, mbs: int, dp: int, rank: int, sharding: bool, epochs: int) -> list[list[int]]:
    """Megatron's MegatronPretrainingRandomSampler as an iterator over whole epochs, from 0 consumed."""
    active = total - total % (mbs * dp)
    out = []
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(epoch)
        if sharding:
            bucket = active // dp
            ids = [rank * bucket + int(i) for i in torch.randperm(bucket, generator=generator)]
        else:
            ids = [int(i) for i in torch.randperm(total - total % mbs, generator=generator)][rank::dp]
        out += [ids[k : k + mbs] for k in range(0, len(ids) - mbs + 1, mbs)][: active // (mbs * dp)]
    return out


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_order_is_megatrons_random_sampler(sharding):
    total, mbs, dp = 23, 2, 2
    for rank in range(dp):
        plan = BatchPlan(global_batch_size=mbs * dp, micro_batch_size=mbs, dp_size=dp, dp_rank=rank)
        ours = [cyclic_sample_indices(plan, step * mbs * dp, total, sharding)[0] for step in range(15)]
        assert ours == _cyclic_reference(total, mbs, dp, rank, sharding, epochs=3)[:15]
    epoch = [i for r in range(dp) for idx in _cyclic_reference(total, mbs, dp, r, sharding, 1) for i in idx]
    assert len(set(epoch)) == len(epoch) == 20  # an epoch: 20 distinct samples of the 23 (to a multiple of mbs x DP)


@pytest.mark.spawns  # (paratron starts the workers)
def test_training_loss_is_the_same_with_workers(tmp_path):
    settings = dict(mock_data=True, eval_iters=0, train_iters=3)
    base = run_training(tiny_config(tmp_path / "w0", **settings, num_workers=0)).losses
    workers = run_training(tiny_config(tmp_path / "w2", **settings, num_workers=2)).losses
    assert workers == base and len(base) == 3
    bundle = build_data(tiny_config(tmp_path / "c", **settings, num_workers=2, dataloader_type="cyclic"), 8)
    assert isinstance(bundle.train, LoaderSource) and len(bundle.train) == 24  # the samples the run reads
    assert (bundle.train.dataloader_type, bundle.train.num_workers, bundle.valid.num_workers) == ("cyclic", 2, 0)
