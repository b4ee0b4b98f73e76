"""`paratron evaluate` scores every token of every file once: losses equal a reference computed
here with the single-device model, the token counts are whole, and a file with nothing to score is
refused with one line. Runs in this process through `paratron.cli.main`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paratron.checkpoint import CheckpointContent, read_checkpoint, save_checkpoint
from paratron.cli import main
from paratron.config import build_config
from paratron.data.indexed import IndexedDatasetWriter
from paratron.data.sft.templates import tokenizer_chat_template
from paratron.data.sft.tokenize import tokenize_file
from paratron.data.tokenizer import Tokenizer
from paratron.model.gpt import GPT, build_model

from tiny import LLAMA_STYLE, write_conversations

SEQ = 16
LONG_FILE = [7, 13, 0, 1, 20, 9]  # document lengths: 50 tokens, 49 scored in 4 windows, the last with 1
SHORT_FILE = [5]  # fewer tokens than one sample
SFT_SEQ = 32  # (a conversation of two short turns takes some 22 tokens with ChatML)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny Llama-like model with weights spread wide (so that every token's loss differs) and
    its tokenizer, saved as a checkpoint; two indexed files of random tokens."""
    folder = tmp_path_factory.mktemp("evaluate")
    write_conversations(folder)
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    config = build_config(
        dict(
            num_layers=2,
            hidden_size=32,
            ffn_hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=tokenizer.vocab_size,
            max_position_embeddings=64,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            mock_data=True,
            **LLAMA_STYLE,
        )
    )
    model = build_model(config.model).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    save_checkpoint(folder / "ckpt", CheckpointContent(0, 0, config, model, tokenizer=tokenizer))
    rng = np.random.default_rng(0)
    streams = {}
    for name, lengths in (("long", LONG_FILE), ("short", SHORT_FILE)):
        documents = [rng.integers(0, tokenizer.vocab_size, n) for n in lengths]
        with IndexedDatasetWriter(folder / name, np.uint16) as writer:
            for document in documents:
                writer.add_document(document)
        streams[name] = np.concatenate(documents).astype(np.int64)
    return dict(folder=folder, model=model, streams=streams)


def evaluate_flags(folder: Path, *extra: str, seq_length: int = SEQ) -> list[str]:
    return [
        "evaluate",
        "--load",
        str(folder / "ckpt"),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(folder / "tokenizer.json"),
        "--seq-length",
        str(seq_length),
        *extra,
    ]


def stream_reference(model: GPT, stream: np.ndarray) -> tuple[float, int]:
    """Summed cross-entropy of every token but the first given the tokens before it in its window
    of SEQ + 1 (the windows share one token), and the number of tokens scored."""
    total, count = 0.0, 0
    for first in range(0, len(stream) - 1, SEQ):
        window = torch.from_numpy(stream[first : first + SEQ + 1])
        with torch.no_grad():
            logits = model(window[None, :-1])[0]
        total += F.cross_entropy(logits.double(), window[1:], reduction="sum").item()
        count += len(window) - 1
    return total, count


@pytest.mark.parametrize("batches", [("2", "4"), ("1", "3")])
def test_evaluate_scores_every_token_of_each_file_once(setup, capsys, batches):
    folder, model, streams = setup["folder"], setup["model"], setup["streams"]
    output = folder / f"eval-{'-'.join(batches)}.json"
    data = ["--data-path", str(folder / "long"), str(folder / "short")]
    flags = evaluate_flags(folder, *data, "--micro-batch-size", batches[0], "--global-batch-size", batches[1])
    assert main([*flags, "--output", str(output)]) == 0, capsys.readouterr().err
    result = json.loads(output.read_text())
    sums = {name: stream_reference(model, stream) for name, stream in streams.items()}
    for name, (total, count) in sums.items():
        assert count == len(streams[name]) - 1  # every token but the file's first
        assert result["tasks"][name]["tokens"] == count
        assert result["tasks"][name]["loss"] == pytest.approx(total / count, abs=1e-6)
    assert result["tokens"] == 49 + 4
    overall = sum(total for total, _ in sums.values()) / 53
    assert result["loss"] == pytest.approx(overall, abs=1e-6)
    assert result["perplexity"] == pytest.approx(np.exp(overall), rel=1e-6)
    assert "short: loss" in capsys.readouterr().out


@pytest.mark.parametrize("tokens", [1, 0])
def test_evaluate_refuses_a_file_with_nothing_to_score(setup, capsys, tokens):
    folder = setup["folder"]
    prefix = folder / f"tiny{tokens}"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document(np.arange(tokens))
    output = folder / f"tiny{tokens}.json"
    flags = evaluate_flags(folder, "--data-path", str(folder / "long"), str(prefix), "--output", str(output))
    assert main(flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    plural = "" if tokens == 1 else "s"
    assert lines == [
        f"error: {prefix}: holds {tokens} token{plural}; a score needs at least 2 (one read, one predicted); "
        "give it more text or leave it out of --data-path"
    ]
    assert not output.exists()


def write_chats(path: Path, conversations: list[list[tuple[str, str]]]) -> None:
    lines = [{"messages": [{"role": role, "content": text} for role, text in turns]} for turns in conversations]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def test_evaluate_conversations_truncated_to_the_sequence_are_scored_to_its_end(setup, capsys):
    """A conversation longer than --seq-length is cut to it (--sft-truncation truncate, the default),
    and that is said; every assistant token within it is scored."""
    folder, model = setup["folder"], setup["model"]
    chats = folder / "truncated.jsonl"
    write_chats(
        chats,
        [
            [("user", "alpha beta"), ("assistant", " ".join(["gamma delta epsilon zeta eta theta iota kappa"] * 3))],
            [("user", "xi"), ("assistant", "pi")],
        ],
    )
    output = folder / "truncated.json"
    flags = ["--sft", "--chat-template", "chatml", "--data-path", str(chats), "--micro-batch-size", "1"]
    assert main([*evaluate_flags(folder, *flags, seq_length=SFT_SEQ), "--output", str(output)]) == 0
    assert "truncated: 1 conversation(s) longer than --seq-length 32 were truncated" in capsys.readouterr().out
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    conversations = tokenize_file(chats, tokenizer_chat_template("chatml", tokenizer), tokenizer)
    assert len(conversations[0].ids) > SFT_SEQ + 1 >= len(conversations[1].ids)
    total, count = 0.0, 0
    for conversation in conversations:
        ids = torch.as_tensor(np.asarray(conversation.ids[: SFT_SEQ + 1], dtype=np.int64))
        trained = torch.as_tensor(np.asarray(conversation.trained[1 : SFT_SEQ + 1], dtype=bool))
        with torch.no_grad():
            losses = F.cross_entropy(model(ids[None, :-1])[0].double(), ids[1:], reduction="none")
        total, count = total + losses[trained].sum().item(), count + int(trained.sum())
    result = json.loads(output.read_text())
    assert result["tokens"] == count > 0
    assert result["loss"] == pytest.approx(total / count, abs=1e-6)


def test_evaluate_refuses_conversations_with_no_assistant_token_in_reach(setup, capsys):
    folder = setup["folder"]
    chats = folder / "unscored.jsonl"
    long_question = " ".join(["alpha beta gamma delta"] * 8)
    write_chats(chats, [[("user", long_question), ("assistant", "omicron")]] * 2)
    flags = evaluate_flags(folder, "--sft", "--chat-template", "chatml", "--data-path", str(chats), seq_length=SFT_SEQ)
    assert main(flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"error: {chats}: none of its 2 conversation(s) has an assistant token within --seq-length 32, so "
        "nothing is scored; give it assistant turns or leave it out of --data-path"
    ]


def test_evaluate_reads_documents_as_the_checkpoints_training_did(setup, tmp_path, capsys):
    """A model trained with --reset-position-ids --reset-attention-mask --eod-mask-loss is scored the
    same way: each document on its own (positions from 0, attention within it, the end-of-document
    token's next-token loss left out), checked against running the model on each piece alone."""
    folder, model = setup["folder"], setup["model"]
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    eod = tokenizer.eod_id
    flags = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    saved = build_config({**dataclasses.asdict(read_checkpoint(folder / "ckpt").config.model), **flags})
    save_checkpoint(tmp_path / "ckpt", CheckpointContent(0, 0, saved, model, tokenizer=tokenizer))
    rng = np.random.default_rng(1)
    with IndexedDatasetWriter(tmp_path / "docs", np.uint16) as writer:
        ordinary = [t for t in range(tokenizer.vocab_size) if t != eod]
        documents = [np.append(rng.choice(ordinary, n), eod) for n in (5, 20, 3, 11)]
        for document in documents:
            writer.add_document(document)
    stream = np.concatenate(documents).astype(np.int64)
    total, count = 0.0, 0
    for first in range(0, len(stream) - 1, SEQ):
        inputs, labels = stream[first : first + SEQ], stream[first + 1 : first + SEQ + 1]
        inputs = inputs[: len(labels)]
        ends = [i + 1 for i, token in enumerate(inputs) if token == eod or i == len(inputs) - 1]
        for start, end in zip([0, *ends[:-1]], ends):
            with torch.no_grad():
                logits = model(torch.from_numpy(inputs[start:end])[None])[0].double()
            for j in range(start, end):
                if inputs[j] != eod:
                    total += F.cross_entropy(logits[j - start], torch.tensor(labels[j])).item()
                    count += 1
    output = tmp_path / "eval.json"
    load = ["--load", str(tmp_path / "ckpt"), "--data-path", str(tmp_path / "docs"), "--output", str(output)]
    flags = evaluate_flags(folder, "--micro-batch-size", "2")  # (its tokenizer and batch, this checkpoint)
    assert main(["evaluate", *flags[3:], *load]) == 0, capsys.readouterr().err
    result = json.loads(output.read_text())
    assert result["tokens"] == count == len(stream) - 1 - 3  # (the last end-of-document token predicts nothing)
    assert result["loss"] == pytest.approx(total / count, abs=1e-6)
