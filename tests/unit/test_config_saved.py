"""A config is resolved once: derived settings filled in when it is built, written back as None, and configs saved
in the older spellings (null widths, use_distributed_optimizer, strings for lists) still load."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from paratron.commands.train import parser as train_parser
from paratron.config import build_config, config_from_dict, config_to_dict, override, validate
from paratron.config.arguments import parse_config_arguments
from paratron.config.fields import all_fields
from paratron.config.schema import Config, ModelConfig
from paratron.errors import ConfigError
from paratron.planning.launch_line import config_arguments

OLD_SAVED = {
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": None,
        "num_query_groups": None,
        "kv_channels": None,
        "activation": "swiglu",
        "openai_gelu": False,
        "num_experts": 4,
        "moe_layer_freq": "[0,1]",
        "lora_targets": "qkv,proj",
    },
    "parallel": {"zero_stage": 0, "use_distributed_optimizer": True},
    "logging": {"profile_ranks": ["0", "1"]},
}
"""A checkpoint's config as paratron wrote it before each fact had one typed field."""


def test_a_config_saved_in_the_older_spellings_loads():
    config = config_from_dict(OLD_SAVED)
    m = config.model
    assert (m.ffn_hidden_size, m.num_query_groups, m.kv_channels) == (128, 4, 16)
    assert m.moe_layer_pattern == (False, True)
    assert m.lora_targets == ("qkv", "proj")
    assert config.parallel.zero_stage == 1
    assert config.logging.profile_ranks == (0, 1)


def test_a_saved_config_keeps_derived_settings_unset_and_reads_back_the_same():
    config = build_config({"hidden_size": 64, "activation": "swiglu", "lora_targets": "fc2, qkv,fc2"})
    saved = config_to_dict(config)
    assert (saved["model"]["ffn_hidden_size"], saved["model"]["num_query_groups"]) == (None, None)
    assert saved["model"]["lora_targets"] == ["fc2", "qkv"] and saved["logging"]["profile_ranks"] == [0]
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(saved))) == config


def test_a_recipe_with_the_distributed_optimizer_means_zero_stage_one(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("parallel:\n  use_distributed_optimizer: true\n", encoding="utf-8")
    assert build_config(recipe=str(recipe)).parallel.zero_stage == 1
    assert build_config({"zero_stage": 2}, recipe=str(recipe)).parallel.zero_stage == 2
    assert "use_distributed_optimizer" not in all_fields()


@pytest.mark.parametrize(
    "argv, stage",
    [
        (["--use-distributed-optimizer"], 1),
        (["--use-distributed-optimizer", "--zero-stage", "2"], 2),
        (["--zero-stage", "2", "--use-distributed-optimizer"], 2),
        (["--no-use-distributed-optimizer"], 0),
    ],
)
def test_the_distributed_optimizer_flag_folds_into_the_zero_stage(argv, stage):
    _, overrides, _ = parse_config_arguments(train_parser(), argv)
    assert build_config(overrides).parallel.zero_stage == stage


def test_derived_settings_follow_a_change_of_what_they_come_from():
    model = ModelConfig(hidden_size=64, num_attention_heads=4, activation="swiglu")
    assert model.derived == frozenset({"ffn_hidden_size", "num_query_groups", "kv_channels", "rope_type"})
    assert (model.rope_type, model.with_changes(multi_latent_attention=True).rope_type) == ("rope", "yarn")
    wider = model.with_changes(hidden_size=128, num_attention_heads=8)
    assert (wider.ffn_hidden_size, wider.num_query_groups, wider.kv_channels) == (320, 8, 16)
    assert model.with_changes(hidden_size=128, ffn_hidden_size=100).ffn_hidden_size == 100
    assert override(Config(model=model), hidden_size=128).model.ffn_hidden_size == 320
    kept = dataclasses.replace(model, hidden_size=128)  # (replace keeps every value, derived ones included)
    assert kept.ffn_hidden_size == 128 and kept == ModelConfig(
        hidden_size=128, activation="swiglu", ffn_hidden_size=128, kv_channels=16
    )


def test_limits_come_from_the_fields():
    assert all_fields()["hidden_size"].limits == {"above": 0}
    assert all_fields()["eval_iters"].limits == {"min": 0}
    assert all_fields()["hidden_dropout"].limits == {"min": 0, "below": 1}
    for settings, message in (
        ({"hidden_size": 0}, "--hidden-size 0: must be at least 1"),
        ({"eval_iters": -1}, "--eval-iters -1: must be zero or more"),
        ({"hidden_dropout": 1.0}, "--hidden-dropout 1.0: must be in [0, 1)"),
        ({"num_experts": 2, "moe_layer_freq": "[0,2]"}, "--moe-layer-freq [0,2]: give a positive integer"),
        ({"lora_rank": 2, "lora_targets": "qkv,attn"}, "--lora-targets qkv,attn: unknown layer attn"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(build_config({**settings, "mock_data": True}), 1)


def test_a_printed_command_line_rebuilds_the_config_without_its_derived_settings():
    config = build_config({"hidden_size": 128, "lora_rank": 2, "lora_targets": "qkv,proj", "profile_ranks": [0, 3]})
    argv = config_arguments(config)
    assert "--ffn-hidden-size" not in argv and "--num-query-groups" not in argv
    assert " ".join(argv).count("--lora-targets qkv proj") == 1
    _, overrides, _ = parse_config_arguments(train_parser(), argv)
    assert build_config(overrides) == config
