"""Megatron-LM's flags: each implemented, accepted without effect or refused by name; the same
defaults and the same carry-on-with-a-warning behaviour as Megatron-LM."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from paratron.commands.train import parser as train_parser
from paratron.commands.train import train_config
from paratron.config import build_config, validate
from paratron.config.arguments import MEGATRON_DOC_MARK, markdown_megatron
from paratron.config.megatron import megatron_flags
from paratron.config.schema import Config, ModelConfig
from paratron.errors import ConfigError, UserError
from paratron.model.gpt import GPT
from paratron.model.mlp import MLP
from paratron.training import resume
from paratron.training.run import run_training

from tiny import tiny_config


def parse(argv: list[str]) -> Config:
    return train_config(argv)


def test_defaults_are_megatron_lms():
    c = Config()
    assert (c.model.hidden_dropout, c.model.attention_dropout, c.optimizer.adam_beta2) == (0.1, 0.1, 0.999)
    assert (c.lr_schedule.lr_decay_style, c.training.eval_batches(False), c.logging.log_interval) == (
        "linear",
        100,
        100,
    )
    assert c.training.eval_batches(True) is None  # (fine-tuning: each held-out conversation once)
    assert c.parallel.moe_token_dispatcher_type == "allgather"
    recipe = build_config(recipe="debug")  # the recipes set modern values themselves
    assert (recipe.model.hidden_dropout, recipe.optimizer.adam_beta2, recipe.lr_schedule.lr_decay_style) == (
        0.0,
        0.95,
        "cosine",
    )
    assert build_config({"model_name": "llama3-8b"}).model.hidden_dropout == 0.0  # and so do the presets


@pytest.mark.parametrize("hidden, width", [(64, 128), (96, 256), (4096, 10880), (5120, 13632)])
def test_swiglu_without_ffn_hidden_size_is_megatrons_width(hidden, width):
    model = ModelConfig(hidden_size=hidden, num_attention_heads=4, activation="swiglu")
    assert model.ffn_hidden_size == int(4 * hidden * 2 / 3 / 64) * 64 == width
    assert ModelConfig(hidden_size=hidden, num_attention_heads=4).ffn_hidden_size == 4 * hidden
    assert ModelConfig(hidden_size=hidden, activation="swiglu", ffn_hidden_size=100).ffn_hidden_size == 100
    if hidden == 64:
        gpt = GPT(dataclasses.replace(model, num_layers=1, vocab_size=32, max_position_embeddings=8))
        widths = {n.split(".")[-2]: p.shape[0] for n, p in gpt.named_parameters() if "mlp.in_proj" in n}
        assert widths == {"gate": width, "up": width}


def test_group_query_attention_as_megatron_reads_it(capsys):
    base = ["--num-attention-heads", "8", "--hidden-size", "64"]
    assert parse(base).model.num_query_groups == 8
    assert parse([*base, "--group-query-attention"]).model.num_query_groups == 1
    assert parse([*base, "--group-query-attention", "--num-query-groups", "2"]).model.num_query_groups == 2
    assert capsys.readouterr().err == ""
    assert parse([*base, "--num-query-groups", "2"]).model.num_query_groups == 8
    assert "--num-query-groups 2 is ignored without --group-query-attention" in capsys.readouterr().err
    assert (
        build_config({"num_query_groups": 2, "num_attention_heads": 8}).model.num_query_groups == 2
    )  # recipes, presets


def test_sequence_parallel_at_tensor_parallel_one_is_turned_off_with_a_warning(capsys):
    config = parse(["--sequence-parallel"])
    assert not config.parallel.sequence_parallel
    assert "--sequence-parallel needs --tensor-model-parallel-size above 1; turned off" in capsys.readouterr().err
    assert parse(["--sequence-parallel", "--tensor-model-parallel-size", "2"]).parallel.sequence_parallel


def test_load_of_the_empty_save_directory_starts_fresh_elsewhere_it_is_refused(tmp_path, capsys):
    from paratron.training.preflight import check_inputs

    same = str(tmp_path / "ckpt")
    config = parse(["--save", same, "--load", same, "--mock-data"])
    assert config.checkpoint.load is None and config.checkpoint.save == same
    assert "holds no checkpoint yet; it is also --save, so training starts from scratch" in capsys.readouterr().err
    (tmp_path / "ckpt" / "iter_0000002").mkdir(parents=True)  # something is there: load it (or fail loudly)
    with pytest.raises(UserError, match="latest_checkpointed_iteration.txt"):  # (its model is read first)
        parse(["--save", same, "--load", same, "--mock-data"])
    elsewhere = parse(["--save", same, "--load", str(tmp_path / "other"), "--mock-data"])
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        check_inputs(elsewhere)


def test_decoder_first_and_last_stage_layers_are_checked_at_one_stage():
    config = parse(["--num-layers", "4", "--decoder-first-pipeline-num-layers", "2", "--mock-data"])
    with pytest.raises(
        ConfigError, match="--decoder-first-pipeline-num-layers 2 with --pipeline-model-parallel-size 1"
    ):
        validate(config, 1)
    validate(parse(["--num-layers", "4", "--decoder-last-pipeline-num-layers", "4", "--mock-data"]), 1)


def test_accepted_flags_change_nothing():
    plain = parse(["--hidden-size", "32"])
    accepted = parse(
        [
            "--hidden-size",
            "32",
            "--use-mcore-models",
            "--transformer-impl",
            "transformer_engine",
            "--attention-backend",
            "flash",
            "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion",
            "--dist-ckpt-strictness",
            "log_all",
        ]
    )
    assert accepted == plain


def test_refusals_name_the_flag_and_suggestions_keep_the_meaning():
    with pytest.raises(ConfigError, match=r"^--use-mup: Megatron-LM's flag is not supported"):
        parse(["--use-mup"])  # not "did you mean --use-..."
    with pytest.raises(ConfigError, match=r"unknown flag --hiden-size; did you mean --hidden-size\?"):
        parse(["--hiden-size", "3"])
    with pytest.raises(ConfigError, match=r"^unknown flag --use-mcore-model \("):
        parse(["--use-mcore-model"])  # no suggestion of a flag that does nothing


def test_every_megatron_flag_of_the_docs_table_and_the_table_is_current():
    path = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"
    text = path.read_text(encoding="utf-8")
    assert text.split(MEGATRON_DOC_MARK, 1)[1] == "\n\n" + markdown_megatron(), "docs/megatron.md: run `make docs`"
    for flag in megatron_flags():
        assert f"`--{flag}`" in text, f"--{flag} is not in docs/megatron.md"


def test_resume_without_rng_and_with_another_schedule(tmp_path, monkeypatch, capsys):
    """--no-load-rng leaves the generators at the seed; a schedule that differs from the checkpoint's
    goes on with the flags' and says so (Megatron-LM stops), or takes the checkpoint's on request."""
    save = tmp_path / "ckpt"
    run_training(tiny_config(lr_warmup_iters=1, run_dir=tmp_path / "a", train_iters=4, save=str(save), save_interval=2))
    whole = _lrs(tmp_path / "a")
    restored = []
    monkeypatch.setattr(resume.rng, "restore", lambda *args: restored.append(args))
    run_training(tiny_config(lr_warmup_iters=1, run_dir=tmp_path / "b", train_iters=4, load=str(save / "iter_0000002")))
    assert len(restored) == 1 and "differs from the checkpoint's" not in capsys.readouterr().out
    run_training(
        tiny_config(
            lr_warmup_iters=1, run_dir=tmp_path / "c", train_iters=4, load=str(save / "iter_0000002"), no_load_rng=True
        )
    )
    assert len(restored) == 1
    run_training(tiny_config(lr_warmup_iters=1, run_dir=tmp_path / "d", train_iters=6, load=str(save / "iter_0000002")))
    longer = _lrs(tmp_path / "d")
    assert "the learning-rate schedule differs from the checkpoint's: decay_steps" in capsys.readouterr().out
    run_training(
        tiny_config(
            tmp_path / "e", train_iters=6, load=str(save / "iter_0000002"), use_checkpoint_opt_param_scheduler=True
        )
    )
    kept = _lrs(tmp_path / "e")
    assert kept[:2] == whole[2:4] and longer[:2] != whole[2:4]


def _lrs(run_dir: Path) -> list[float]:
    return [json.loads(line)["lr"] for line in open(run_dir / "metrics.jsonl")]


def test_position_flags_as_megatron_reads_them(capsys):
    rope = parse(["--position-embedding-type", "rope", "--no-position-embedding"])
    assert rope.model.position_embedding_type == "rope"
    with pytest.raises(ConfigError, match="^--no-position-embedding is deprecated"):
        parse(["--no-position-embedding"])
    assert parse(["--rotary-percent", "0.5"]).model.rotary_percent == 0.5
    assert (
        "--rotary-percent shapes rotary embeddings; with --position-embedding-type learned_absolute it is ignored"
        in (capsys.readouterr().err)
    )


def test_gelu_is_megatrons_exact_one_unless_openai_gelu():
    x = torch.randn(3, 32)
    for openai, approximate in ((False, "none"), (True, "tanh")):
        mlp = MLP(ModelConfig(hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, openai_gelu=openai))
        (up,) = mlp.in_proj(x)
        torch.testing.assert_close(mlp(x), mlp.out_proj(torch.nn.functional.gelu(up, approximate=approximate)))
    assert build_config({"model_name": "gpt2-small"}).model.openai_gelu  # GPT-2's own GELU


def test_no_accepted_flag_is_shadowed_by_a_setting():
    from paratron.config.arguments import _IGNORED
    from paratron.config.megatron import ACCEPTED

    options = train_parser()._option_string_actions
    shadowed = [f for f, entry in ACCEPTED.items() if not entry.noted and options["--" + f].dest != _IGNORED]
    assert not shadowed, f"settings now: drop them from ACCEPTED: {shadowed}"


def test_save_retain_interval_keeps_the_multiples_and_the_newest(tmp_path):
    from paratron.checkpoint.prune import prune_checkpoints

    for step in (2, 4, 6, 8, 10):
        (tmp_path / f"iter_{step:07d}").mkdir()
        (tmp_path / f"iter_{step:07d}" / "meta.json").write_text("{}")
    deleted = prune_checkpoints(tmp_path, 0, retain_interval=4)
    assert [p.name for p in deleted] == ["iter_0000002", "iter_0000006"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000004", "iter_0000008", "iter_0000010"]
    assert train_config(["--save-retain-interval", "4"]).checkpoint.save_retain_interval == 4


def test_a_translated_flag_refuses_another_word_in_one_line():
    assert train_config(["--data-parallel-sharding-strategy", "optim_grads"]).parallel.zero_stage == 2
    with pytest.raises(ConfigError, match="^--data-parallel-sharding-strategy bogus: choose one of no_shard, optim"):
        train_config(["--data-parallel-sharding-strategy", "bogus"])


def test_a_checkpoint_saved_before_megatron_defaults_keeps_its_model():
    from paratron.config.loading import config_from_dict, config_to_dict

    old = config_to_dict(build_config({"activation": "swiglu", "hidden_size": 64}))
    del old["model"]["openai_gelu"]  # (what such a checkpoint's config lacks)
    model = config_from_dict(old).model
    assert model.openai_gelu and model.ffn_hidden_size == 4 * 64
    assert not config_from_dict(config_to_dict(build_config({"hidden_size": 64}))).model.openai_gelu


CORE_0_16_1 = Path(__file__).resolve().parents[1] / "data" / "megatron" / "megatron_flags_core_0.16.1.txt"
"""Megatron-LM's parser flags at core_v0.16.1 (the list megatron_flags.txt held before main's)."""


def test_every_flag_new_since_core_0_16_1_is_classified():
    """Each flag Megatron-LM main added is a setting, a switch, accepted with a reason or refused with one:
    none falls to the generic "not implemented" line without having been looked at."""
    from paratron.config.arguments import _IGNORED
    from paratron.config.megatron import ACCEPTED, FOLDED, MAPPED, REFUSED, RENAMES, SWITCHES

    old = {line[2:] for line in CORE_0_16_1.read_text().splitlines() if line.startswith("--")}
    new = megatron_flags() - old
    assert len(new) > 200 and "step-batch-size-schedule" in new  # (the list is main's)
    options = train_parser()._option_string_actions
    settings = {flag[2:] for flag, action in options.items() if action.dest != _IGNORED}
    named = set(ACCEPTED) | set(REFUSED) | {f.replace("_", "-") for f in (*SWITCHES, *MAPPED, *FOLDED)}
    named |= {flag[2:] for flag in RENAMES} | settings
    assert sorted(new - named) == []
    assert not set(ACCEPTED) & set(REFUSED)


@pytest.mark.parametrize(
    "argv, refusal",
    [
        (["--muon-nesterov"], "--muon-nesterov: Megatron-LM's flag is not supported: --optimizer is adam or sgd"),
        (["--inference-shards", "tp=2"], "a setting of Megatron-LM's inference engine, which training does not start"),
        (["--rl-profile"], "reinforcement learning is not implemented"),
        (["--enable-mhc-connections"], "hyper-connections (several residual streams) are not implemented"),
    ],
)
def test_new_flags_are_refused_with_their_reason(argv, refusal):
    with pytest.raises(ConfigError) as error:
        parse(argv)
    assert refusal in str(error.value) and "\n" not in str(error.value)


def test_new_accepted_flags_change_nothing_and_new_switches_set_their_setting():
    plain = parse(["--hidden-size", "32"])
    accepted = ["--flash-attention-version", "3", "--mlp-chunks-for-training", "4", "--nvtx-ranges"]
    accepted += ["--ddp-param-name-patterns-for-fp32-local-accumulation", "all", "--no-align-grad-reduce"]
    assert parse(["--hidden-size", "32", *accepted]) == plain
    assert parse(["--dataloader-inter-document-masking"]).data.reset_attention_mask


def test_a_split_keeps_the_quotes_a_launch_script_left_as_megatron_reads_it():
    from paratron.config.validation import parse_split

    assert parse_split("'99,1,0'") == parse_split("99,1,0") == (0.99, 0.01, 0.0)
