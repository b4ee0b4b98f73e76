"""Where a run's settings come from: the checkpoint it loads gives the model (and the tokenizer), the recipe and
--model give defaults, the command line wins; a contradiction or an error names where the value came from."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from paratron.checkpoint.formats import paratron_to_megatron
from paratron.checkpoint.model_of import megatron_tokenizer
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.cli import main
from paratron.commands.train import train_config
from paratron.config import build_config, validate
from paratron.config.loading import SavedModel, resolve_settings
from paratron.config.schema import MODEL_ADJUSTABLE, MODEL_ARCHITECTURE, ModelConfig
from paratron.data.tokenizer import train_byte_level_bpe
from paratron.errors import ConfigError
from paratron.model.gpt import build_model

from tiny import WORDS

QUIET = ["--no-progress-bar", "--no-tensorboard", "--log-interval", "1", "--eval-iters", "0"]
SHORT = ["--train-iters", "1", "--micro-batch-size", "2", "--seq-length", "16", *QUIET]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, str]:
    """A tiny Llama saved by transformers with a tokenizer.json, converted by `paratron convert` (and what the
    converter printed)."""
    root = tmp_path_factory.mktemp("llama")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(50)]
    tokenizer = train_byte_level_bpe(iter(texts), 300)
    hf = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf).save_pretrained(root / "hf")
    tokenizer.save(root / "hf" / "tokenizer.json")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["convert", "--from", "hf", str(root / "hf"), "--to", "paratron", str(root / "ckpt")]) == 0
    (root / "corpus.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    return root, printed.getvalue()


@pytest.fixture(scope="module")
def gpt(tmp_path_factory) -> Path:
    """A tiny paratron checkpoint of a GPT-2-like model (learned positions), saved at step 3."""
    folder = tmp_path_factory.mktemp("gpt") / "ckpt"
    config = build_config(
        dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=32)
    )
    save_checkpoint(folder, CheckpointContent(3, 24, config, build_model(config.model, "cpu")))
    return folder


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_every_model_setting_is_architecture_or_adjustable():
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(MODEL_ARCHITECTURE + MODEL_ADJUSTABLE) == sorted(fields), "classify each ModelConfig field once"
    assert set(ModelConfig().architecture()) == set(MODEL_ARCHITECTURE)


def test_the_same_model_spelled_two_ways_has_one_architecture():
    derived = ModelConfig(hidden_size=64, num_attention_heads=4, activation="swiglu")
    spelled = ModelConfig(hidden_size=64, num_attention_heads=4, activation="swiglu", ffn_hidden_size=128)
    assert derived.architecture() == dataclasses.replace(spelled, num_query_groups=4, kv_channels=16).architecture()
    assert derived.architecture() != spelled.with_changes(group_query_attention=True).architecture()
    rope = ModelConfig(position_embedding_type="rope")
    assert rope.architecture() == dataclasses.replace(rope, max_position_embeddings=4096).architecture()
    assert ModelConfig().architecture() != ModelConfig(max_position_embeddings=4096).architecture()


def test_a_converted_llama_trains_without_model_flags_with_its_tokenizer(llama, tmp_path, capsys):
    root, printed = llama
    assert f"train from it with: paratron train --load {root / 'ckpt'} --finetune ..." in printed
    cache = tmp_path / "cache"
    text = ["--data-path", str(root / "corpus.jsonl"), "--data-cache-path", str(cache), "--run-dir", str(tmp_path)]
    assert main(["train", "--load", str(root / "ckpt"), "--finetune", *text, *SHORT]) == 0
    out = capsys.readouterr().out
    assert "(2 layers, hidden 32, 4 heads, vocab 320)" in out and "its weights only (--finetune)" in out
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not list(cache.glob("tokenizer-bpe*")), "trained a new tokenizer instead of using the checkpoint's"
    assert list(cache.glob("corpus-*"))


def test_a_contradicting_setting_is_refused_naming_both_values_and_where_it_came_from(llama, capsys):
    load = str(llama[0] / "ckpt")
    assert main(["train", "--load", load, "--finetune", "--mock-data", "--hidden-size", "256"]) == 2
    assert error_line(capsys) == (
        f"error: --hidden-size 256 contradicts the checkpoint {load} (hidden size 32); leave it out to use the "
        "checkpoint's"
    )
    assert main(["train", "--load", load, "--finetune", "--group-query-attention", "--num-query-groups", "1"]) == 2
    assert f"error: --num-query-groups 1 contradicts the checkpoint {load} (query groups 2)" in error_line(capsys)
    assert main(["train", "--config", "debug", "--load", load, "--finetune"]) == 2
    assert error_line(capsys).startswith(
        "error: --hidden-size 64 (from model_name debug in the recipe debug) contradicts the checkpoint"
    )
    # what may change when fine-tuning changes, and the same values in other spellings agree
    same = ["--num-query-groups", "2", "--group-query-attention", "--ffn-hidden-size", "64", "--swiglu"]
    other = ["--hidden-dropout", "0.2", "--lora-rank", "4", "--attention-type", "document", "--lr", "0.1"]
    config = train_config(["--load", load, "--finetune", "--mock-data", *same, *other])
    assert (config.model.hidden_size, config.model.num_query_groups, config.model.hidden_dropout) == (32, 2, 0.2)
    assert (config.model.lora_rank, config.model.attention_type) == (4, "document")


def test_a_resume_keeps_the_rule_and_raising_a_rotary_models_length_is_no_contradiction(gpt, llama, capsys):
    assert main(["train", "--load", str(gpt), "--mock-data", "--num-layers", "3"]) == 2
    assert f"--num-layers 3 contradicts the checkpoint {gpt} (num layers 2)" in error_line(capsys)
    assert main(["train", "--load", str(gpt), "--mock-data", "--max-position-embeddings", "64"]) == 2
    assert "(max position embeddings 32)" in error_line(capsys)  # a learned table: a shape
    rope = train_config(["--load", str(llama[0] / "ckpt"), "--mock-data", "--max-position-embeddings", "128"])
    assert rope.model.max_position_embeddings == 128  # rotary embeddings: only a limit


def test_an_error_about_a_value_from_the_checkpoint_says_so_also_in_evaluate(llama, capsys):
    load = str(llama[0] / "ckpt")
    line = "--seq-length 128 exceeds --max-position-embeddings 64; lower the first or raise the second"
    assert main(["train", "--load", load, "--finetune", "--mock-data", "--seq-length", "128"]) == 2
    assert error_line(capsys) == f"error: {line} (--max-position-embeddings 64 comes from the checkpoint {load})"
    assert main(["evaluate", "--load", load, "--data-path", "x.jsonl", "--seq-length", "128"]) == 2
    assert error_line(capsys) == f"error: {line} (--max-position-embeddings 64 comes from the checkpoint {load})"


def test_a_megatron_lm_checkpoint_gives_its_model(llama, tmp_path, capsys):
    paratron_to_megatron(llama[0] / "ckpt", tmp_path / "megatron")
    converted = train_config(["--load", str(llama[0] / "ckpt"), "--finetune", "--mock-data"]).model
    model = train_config(["--load", str(tmp_path / "megatron"), "--finetune", "--mock-data"]).model
    assert model.architecture() == converted.architecture() and model.num_layers == 2
    assert main(["train", "--load", str(tmp_path / "megatron"), "--mock-data", "--num-layers", "3"]) == 2
    assert f"contradicts the checkpoint {tmp_path / 'megatron'} (num layers 2)" in error_line(capsys)


def test_use_checkpoint_args_is_accepted_and_the_checkpoint_wins(llama, capsys):
    load = str(llama[0] / "ckpt")
    config = train_config(["--load", load, "--mock-data", "--hidden-size", "256", "--use-checkpoint-args"])
    assert config.model.hidden_size == 32
    assert (
        f"note: --hidden-size 256 gives way to the checkpoint {load}'s hidden size 32 (--use-checkpoint-args)"
        in capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match="--use-checkpoint-args takes the model's settings from the checkpoint"):
        train_config(["--mock-data", "--use-checkpoint-args"])


def test_megatron_lm_tokenizer_settings_serve_a_run_that_names_none():
    args = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "/data/tok", "vocab_file": None}
    saved = SavedModel("the checkpoint m", dataclasses.asdict(ModelConfig()), megatron_tokenizer(args))
    resolved = resolve_settings({"data_path": ["d"], "load": "m"}, read_checkpoint=lambda _: saved)
    assert (resolved.config.data.tokenizer_type, resolved.config.data.tokenizer_model) == (
        "HuggingFaceTokenizer",
        "/data/tok",
    )
    assert resolved.origins["tokenizer_model"] == "the checkpoint m"
    named = resolve_settings(
        {"data_path": ["d"], "tokenizer_type": "NullTokenizer", "load": "m"}, read_checkpoint=lambda _: saved
    ).config.data
    assert (named.tokenizer_type, named.tokenizer_model) == ("NullTokenizer", None)
    assert (
        resolve_settings({"mock_data": True, "load": "m"}, read_checkpoint=lambda _: saved).config.data.tokenizer_type
        is None
    )
    odd = SavedModel("the checkpoint m", saved.model, {"tokenizer_type": "MultimodalTokenizer"})
    with pytest.raises(ConfigError, match="trained with Megatron-LM's MultimodalTokenizer, which paratron does not"):
        resolve_settings({"data_path": ["d"], "load": "m"}, read_checkpoint=lambda _: odd)


def test_a_data_source_on_the_command_line_replaces_the_recipes():
    demo = train_config(["--config", "demo", "--data-path", "x.jsonl"]).data
    assert (demo.data_path, demo.corpus, demo.split) == (["x.jsonl"], None, "969,30,1")
    assert train_config(["--config", "demo"]).data.corpus == "stdlib"
    debug = train_config(["--config", "debug", "--train-data-path", "t", "--valid-data-path", "v"]).data
    assert (debug.mock_data, debug.train_data_path, debug.valid_data_path) == (False, ["t"], ["v"])
    assert train_config(["--config", "debug", "--no-mock-data", "--corpus", "stdlib"]).data.mock_data is False


def test_a_shorter_run_scales_the_recipes_schedule_with_a_note(capsys):
    config = train_config(["--config", "debug", "--train-iters", "3"])
    assert config.lr_schedule.lr_warmup_iters == 1
    validate(config, 1)
    assert capsys.readouterr().err == (
        "note: --lr-warmup-iters 5 (from the recipe debug) does not fit --train-iters 3: scaled to 1 (5 x 3/50)\n"
    )
    assert train_config(["--config", "debug"]).lr_schedule.lr_warmup_iters == 5  # the recipe's own run
    assert train_config(["--config", "debug", "--train-iters", "20"]).lr_schedule.lr_warmup_iters == 5  # fits
    assert train_config(["--config", "demo", "--train-iters", "50"]).lr_schedule.lr_warmup_iters == 3
    assert "(60 x 50/900)" in capsys.readouterr().err


def test_an_error_caused_by_a_recipe_value_names_the_recipe(capsys):
    assert main(["train", "--config", "debug", "--lr-decay-iters", "4"]) == 2
    assert error_line(capsys) == (
        "error: --lr-warmup-iters 5 exceeds the decay length 4; lower it or raise --lr-decay-iters "
        "(--lr-warmup-iters 5 comes from the recipe debug)"
    )
    assert main(["train", "--config", "debug", "--seq-length", "512"]) == 2
    assert error_line(capsys).endswith(
        "(--max-position-embeddings 256 comes from model_name debug in the recipe debug)"
    )


@pytest.mark.spawns  # (paratron starts the workers)
def test_evaluate_and_generate_read_a_megatron_lm_checkpoint_as_its_paratron_twin(llama, tmp_path, monkeypatch, capsys):
    """A Megatron-LM checkpoint written from a converted Llama (its tokenizer in DST/tokenizer, named by the args)
    evaluates and generates as the paratron checkpoint does, without model or tokenizer flags."""
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache"))
    root = llama[0]
    paratron_to_megatron(root / "ckpt", tmp_path / "written")
    (tmp_path / "written").rename(tmp_path / "megatron")  # (moved: its args name the tokenizer where it was)
    assert (tmp_path / "megatron" / "tokenizer" / "tokenizer.json").is_file()
    seen = {}
    for name, load in (("paratron", root / "ckpt"), ("megatron", tmp_path / "megatron")):
        capsys.readouterr()
        assert main(["generate", "--load", str(load), "--prompt", "the", "--max-new-tokens", "5"]) == 0
        text = capsys.readouterr().out
        output = tmp_path / f"{name}.json"
        data = ["--data-path", str(root / "corpus.jsonl"), "--seq-length", "16", "--micro-batch-size", "2"]
        assert main(["evaluate", "--load", str(load), *data, "--output", str(output)]) == 0, capsys.readouterr().err
        seen[name] = text, json.loads(output.read_text())
    assert seen["megatron"][0] == seen["paratron"][0] and seen["paratron"][0].startswith("the")
    ours, theirs = seen["paratron"][1], seen["megatron"][1]
    assert theirs["tokens"] == ours["tokens"] > 0 and theirs["loss"] == pytest.approx(ours["loss"], rel=1e-5)
    # two processes: one converts it into the cache (a fresh one here), the other waits, both evaluate
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache2"))
    output = tmp_path / "two.json"
    assert main(["evaluate", "--load", str(tmp_path / "megatron"), *data, "--nproc", "2", "--output", str(output)]) == 0
    assert json.loads(output.read_text())["loss"] == pytest.approx(ours["loss"], rel=1e-5)


def test_a_null_tokenizers_id_count_is_not_the_checkpoints_vocabulary():
    """NullTokenizer(V) has V + 1 entries (its end-of-document id is V): the checkpoint says V + 1, the run says
    --vocab-size V, and neither contradicts the other; without --vocab-size the run is asked for it."""
    saved = SavedModel("the checkpoint m", dataclasses.asdict(ModelConfig(vocab_size=101)))
    data = {"data_path": ["d"], "tokenizer_type": "NullTokenizer"}
    assert (
        resolve_settings(
            {**data, "vocab_size": 100, "load": "m"}, read_checkpoint=lambda _: saved
        ).config.model.vocab_size
        == 100
    )
    unsized = resolve_settings({**data, "load": "m"}, read_checkpoint=lambda _: saved).config
    with pytest.raises(ConfigError, match="--tokenizer-type NullTokenizer needs --vocab-size"):
        validate(unsized, 1, check_data=True)


def test_a_hugging_face_folder_given_to_load_is_named_with_its_conversion(llama, capsys):
    hf = llama[0] / "hf"
    assert main(["train", "--load", str(hf), "--finetune", "--mock-data"]) == 2
    assert error_line(capsys) == (
        f"error: {hf}: a Hugging Face model folder, not a checkpoint; convert it once with paratron convert --from hf "
        f"{hf} --to paratron CKPT and give --load CKPT"
    )
