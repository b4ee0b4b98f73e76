"""A fine-tuned checkpoint remembers how it was trained: its chat template is kept beside its tokenizer (as
chat_template.jinja, which transformers reads) for evaluate, generate, serve and conversion; a fine-tuning run's
--seq-length defaults to the checkpoint's context; cut conversations are counted in the run's summary and refused
with --no-truncate; and without --eval-iters a fine-tuning run scores each held-out conversation once.

Every command runs in this process through `paratron.cli.main`; none starts a worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from test_cli import QUIET, assert_one_line_error, in_process

from paratron.checkpoint.pretrained import tokenizer_from_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.cli import main
from paratron.data.sft import tokenizer_chat_template
from paratron.data.sft.templates import CHATML

from tiny import write_conversations

CONTEXT = 96
"""The base model's --max-position-embeddings."""
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
STEPS = ["--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2", "--lr-warmup-iters", "0"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """The conversations' folder, and a model trained on them with --sft --chat-template chatml (its tokenizer's
    folder holds no template of its own)."""
    root = tmp_path_factory.mktemp("remembers")
    write_conversations(root / "data")
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "data/tokenizer.json")]
    assert not (root / "data/chat_template.jinja").exists()
    code = main([
        "train", *MODEL, "--max-position-embeddings", str(CONTEXT), *tokenizer, "--sft", "--chat-template", "chatml",
        "--data-path", str(root / "data/chat.jsonl"), "--seq-length", "64", *STEPS, "--eval-iters", "0",
        "--save", str(root / "base"), "--run-dir", str(root / "base-run"), *QUIET,
    ])  # fmt: skip
    assert code == 0
    return root / "data", root / "base"


def finetune(capsys, data: Path, load: Path, root: Path, *flags: str):
    return in_process(
        capsys, "train", "--load", str(load), "--finetune", "--sft", "--data-path", str(data / "chat.jsonl"),
        *STEPS, "--eval-iters", "0", "--run-dir", str(root / "run"), *QUIET, *flags,
    )  # fmt: skip


def test_the_template_a_run_trained_with_is_kept_and_used(base, tmp_path, capsys):
    data, checkpoint = base
    saved = checkpoint / "iter_0000002" / "chat_template.jinja"
    assert saved.read_text(encoding="utf-8") == CHATML
    # fine-tuning again, evaluating and converting need no --chat-template
    result = finetune(capsys, data, checkpoint, tmp_path, "--save", str(tmp_path / "ft"))
    assert result.returncode == 0, result.stderr
    info = read_checkpoint(tmp_path / "ft")
    assert (info.path / "chat_template.jinja").read_text(encoding="utf-8") == CHATML
    template = tokenizer_chat_template("tokenizer", tokenizer_from_checkpoint(info))  # (generate's and serve's)
    assert template.source == CHATML
    output = tmp_path / "eval.json"
    result = in_process(
        capsys, "evaluate", "--load", str(tmp_path / "ft"), "--sft", "--data-path", str(data / "qa.jsonl"),
        "--output", str(output),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(output.read_text())["tokens"] > 0
    converted = ["--from", "paratron", str(tmp_path / "ft"), "--to", "hf", str(tmp_path / "hf")]
    result = in_process(capsys, "convert", *converted)
    assert result.returncode == 0, result.stderr
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == CHATML


def test_finetuning_takes_the_checkpoints_context_as_its_seq_length(base, tmp_path, capsys):
    data, checkpoint = base
    result = finetune(capsys, data, checkpoint, tmp_path, "--save", str(tmp_path / "ft"))
    assert result.returncode == 0, result.stderr
    assert read_checkpoint(tmp_path / "ft").config.data.seq_length == CONTEXT
    assert f"x {CONTEXT} tokens" in result.stdout


def test_truncation_is_counted_in_the_summary_and_refused_with_no_truncate(base, tmp_path, capsys):
    data, checkpoint = base
    result = finetune(capsys, data, checkpoint, tmp_path, "--seq-length", "12")
    assert result.returncode == 0, result.stderr
    summary = [line for line in result.stdout.splitlines() if line.startswith("truncated: ")]
    assert len(summary) == 1, result.stdout
    cut = int(summary[0].split()[1])
    # (--split 969,30,1 leaves 39 of the 40 conversations for training)
    assert 0 < cut <= 39 and " of 39 training conversations were longer than --seq-length 12" in summary[0]
    result = finetune(capsys, data, checkpoint, tmp_path, "--seq-length", "12", "--no-truncate")
    assert_one_line_error(result, "chat.jsonl:")
    assert "--no-truncate" in result.stderr and "raise --seq-length or drop the long conversations" in result.stderr


def test_without_eval_iters_each_held_out_conversation_is_scored_once(base, tmp_path, capsys):
    data, checkpoint = base
    result = in_process(
        capsys, "train", "--load", str(checkpoint), "--finetune", "--sft", "--seq-length", "64",
        "--train-data-path", str(data / "chat.jsonl"), "--valid-data-path", str(data / "qa.jsonl"), *STEPS,
        "--eval-interval", "2", "--save", str(tmp_path / "ft"), "--run-dir", str(tmp_path / "run"), *QUIET,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    during = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    output = tmp_path / "eval.json"
    result = in_process(
        capsys, "evaluate", "--load", str(tmp_path / "ft"), "--sft", "--data-path", str(data / "qa.jsonl"),
        "--seq-length", "64", "--micro-batch-size", "4", "--output", str(output),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    whole = json.loads(output.read_text())
    assert during["tasks"]["qa"]["tokens"] == whole["tokens"]  # every answer token of the 30 pairs, once
    assert during["val_loss"] == pytest.approx(whole["loss"], rel=1e-5)
