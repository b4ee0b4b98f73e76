"""The demos' closing generation fits the model's context whatever this Python's standard library holds: the
fine-tuning demo picks a held-out instruction that leaves room for its answer (or asks for the room left), and the
vision-language demo asks for no more new tokens than the context leaves after a long question."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.config import build_config
from paratron.data.tokenizer import Tokenizer
from paratron.model.gpt import build_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import finetune_demo  # noqa: E402  (the scripts, by name)
import vlm_demo  # noqa: E402


def words(text: str) -> int:
    return len(text.split())


def pair(n: int) -> dict[str, str]:
    return {"prompt": " ".join(["word"] * n), "completion": "pass"}


def test_the_finetune_demo_skips_an_instruction_too_long_for_its_answer():
    pairs = [pair(73), pair(40), pair(20)]  # the first: 73 prompt tokens + 100 new ones exceed a context of 128
    chosen, new = finetune_demo.closing_prompt(pairs, words, context=128, wanted=100)
    assert (chosen, new) == (pairs[2], 100)


def test_the_finetune_demo_asks_for_what_the_context_leaves_when_no_instruction_leaves_enough():
    pairs = [pair(73), pair(60), pair(90)]
    chosen, new = finetune_demo.closing_prompt(pairs, words, context=128, wanted=100)
    assert (chosen, new) == (pairs[1], 68)
    with pytest.raises(SystemExit, match="context of 50"):
        finetune_demo.closing_prompt(pairs, words, context=50, wanted=100)


def test_the_finetune_demo_counts_prompts_as_generate_renders_them(tmp_path):

    vlm_demo.write_tokenizer(tmp_path / "tokenizer.json")  # (a tokenizer with ChatML's tokens)
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    model = dict(num_layers=1, hidden_size=16, num_attention_heads=2, max_position_embeddings=40)
    config = build_config({**model, "vocab_size": tokenizer.vocab_size})
    save_checkpoint(tmp_path / "ckpt", CheckpointContent(1, 0, config, build_model(config.model), tokenizer=tokenizer))
    count, context = finetune_demo.chat_prompt_tokens(tmp_path / "ckpt")
    rendered = "<|im_start|>user\nwhat shape is it?<|im_end|>\n<|im_start|>assistant\n"
    assert context == 40 and count("what shape is it?") == len(tokenizer.encode(rendered))


def test_the_vlm_demo_answers_a_long_question_within_the_context(tmp_path):
    vlm_demo.write_tokenizer(tmp_path / "tokenizer.json")

    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    answerer = vlm_demo.Answerer.of(vlm_demo.initial_model(tokenizer), tokenizer)
    scene = vlm_demo.random_scene(random.Random(0))
    vlm_demo.draw(scene, tmp_path / "picture.png")
    question = " ".join(["what colour is the shape?"] * 2)
    ids, _ = answerer.prompt(question, [tmp_path / "picture.png"])
    context = vlm_demo.MODEL["max_position_embeddings"]
    assert context - len(ids) < vlm_demo.NEW_TOKENS["caption"]  # (the question leaves less than a caption's room)
    assert answerer.new_tokens(len(ids), vlm_demo.NEW_TOKENS["caption"]) == context - len(ids)
    said = answerer.answers(question, [tmp_path / "picture.png"], vlm_demo.NEW_TOKENS["caption"])
    assert said == [answerer.answer(question, tmp_path / "picture.png", vlm_demo.NEW_TOKENS["caption"])]
