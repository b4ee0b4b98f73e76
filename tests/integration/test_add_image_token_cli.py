"""A vision-language fine-tune started from a text checkpoint whose tokenizer has no `<image>`: every refusal on
the way is one line naming a fix, and each fix named works: --add-image-token (the saved checkpoint then holds the
tokenizer with `<image>` as its next id and the grown vocabulary, the new row the mean of the old), an existing
token's id with --image-token-id, and --add-image-token with a tokenizer that already gained `<image>`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_cli import QUIET, assert_one_line_error, in_process
from tokenizers import AddedToken

from paratron.checkpoint.load import read_weight
from paratron.checkpoint.verify import read_checkpoint
from paratron.cli import main
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe

from tiny import WORDS

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--max-position-embeddings", "64"]
STEPS = ["--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    """A text checkpoint (its tokenizer without <image>), a conversation file with images, and the same tokenizer
    with <image> added (tokenizer-image/)."""
    root = tmp_path_factory.mktemp("text-to-vision")
    tokenizer = train_byte_level_bpe(iter([" ".join(WORDS)] * 20), 280)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    for name, extra in (("tokenizer", ()), ("tokenizer-image", ("<image>",))):
        (root / name).mkdir()
        tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in extra])
        tokenizer.save(root / name / "tokenizer.json")
    (root / "text.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(16)) * 8)
    Image.new("RGB", (20, 12), (200, 40, 40)).save(root / "a.png")
    turns = [{"from": "human", "value": "<image>\nalpha beta"}, {"from": "gpt", "value": "gamma delta"}]
    (root / "chat.jsonl").write_text(json.dumps({"image": "a.png", "conversations": turns}) + "\n")
    common = [*MODEL, *STEPS, *QUIET, "--seq-length", "32", "--data-cache-path", str(root / "cache")]
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tokenizer")]
    text = ["--data-path", str(root / "text.txt"), "--save", str(root / "text"), "--run-dir", str(root / "run")]
    assert main(["train", *common, *flags, *text]) == 0
    return root


def _vision(root: Path, run: str, *flags: str, load: str = "text") -> list[str]:
    return [
        "train",
        "--vision-model",
        "debug-vit",
        "--finetune",
        "--load",
        str(root / load),
        "--sft",
        "--data-path",
        str(root / "chat.jsonl"),
        "--chat-template",
        "chatml",
        "--seq-length",
        "48",
        *STEPS,
        *QUIET,
        "--data-cache-path",
        str(root / "cache"),
        "--run-dir",
        str(root / run),
        *flags,
    ]


@pytest.mark.parametrize(
    "flags, expected",
    [
        ((), "has no <image> token for images; add --add-image-token (it adds one and grows the vocabulary"),
        (("--tokenizer-special-tokens", "<image>"), "(to give it an image token <image>, use --add-image-token)"),
        (
            ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{root}/tokenizer-image"),
            "is smaller than the tokenizer's {v1}; raise it, add --add-image-token to grow the checkpoint's vocabulary",
        ),
        (
            ("--tokenizer-model", "{root}/tokenizer-image", "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-size",
             "{v1}"),
            "embedding.weight has shape [{v}, 32] there but [{v1}, 32] in this model: the tokenizer has 1 token(s) "
            "more than the checkpoint's vocabulary; add --add-image-token",
        ),
    ],
    ids=["no-image-token", "special-tokens", "larger-tokenizer", "larger-vocab-size"],
)  # fmt: skip
def test_each_refusal_on_the_way_names_add_image_token(text_run, capsys, flags, expected):
    v = Tokenizer.from_file(text_run / "tokenizer").vocab_size
    flags = tuple(f.format(root=text_run, v1=v + 1) for f in flags)
    expected = expected.format(v=v, v1=v + 1)
    assert_one_line_error(in_process(capsys, *_vision(text_run, "refused", *flags)), expected)


def test_add_image_token_grows_the_checkpoint_and_saves_the_tokenizer(text_run, capsys):
    save = text_run / "vision"
    frozen = ("--freeze-vision-model", "--freeze-language-model")  # (the projector trains: the rows stay)
    result = in_process(capsys, *_vision(text_run, "grown", "--add-image-token", *frozen, "--save", str(save)))
    assert result.returncode == 0, result.stderr
    info = read_checkpoint(save)
    v = Tokenizer.from_file(text_run / "tokenizer").vocab_size
    tokenizer = Tokenizer.from_file(info.path / "tokenizer.json")
    assert tokenizer.hf.token_to_id("<image>") == v and tokenizer.vocab_size == v + 1
    assert info.config.model.vocab_size == v + 1 and info.config.model.image_token_id == v
    old = read_weight(read_checkpoint(text_run / "text"), "embedding.weight")
    grown = read_weight(info, "embedding.weight")
    assert grown.shape == (v + 1, 32) and torch.equal(grown[:v], old)
    torch.testing.assert_close(grown[v], old.double().mean(0).float(), rtol=0, atol=1e-7)
    # the next stage loads it as it is; the flag, kept, adds nothing
    again = in_process(capsys, *_vision(text_run, "again", "--add-image-token", load="vision"))
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ("--image-token-id", "5"),
        (
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "{root}/tokenizer-image",
            "--add-image-token",
        ),
    ],
    ids=["existing-token-id", "larger-tokenizer-grown"],
)
def test_the_other_named_fixes_work(text_run, capsys, flags):
    flags = tuple(f.format(root=text_run) for f in flags)
    result = in_process(capsys, *_vision(text_run, "fixed", *flags))
    assert result.returncode == 0, result.stderr
