"""A Hugging Face config.json that leaves fields out is read as transformers reads it. For every supported
model type, each field of a config.json saved by transformers is left out once: the conversion either
gives the model transformers builds from the short file (its own config class fills the field), or,
where that model does not fit the weights, stops with one line naming the file and the field. Damaged
or missing weight files are refused in one line too."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers  # the reference; installed with the test extras

from paratron.checkpoint.hf import ARCHITECTURES, config_for_hf, model_from_hf, model_settings
from paratron.cli import main
from paratron.errors import CheckpointError

from tiny import save_random_hf_model

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
)
"""A tiny Llama-family shape, its values off transformers' defaults."""
FULL = {
    "llama": dict(SHAPE, tie_word_embeddings=True),
    "mistral": dict(SHAPE, sliding_window=8),
    "qwen2": dict(SHAPE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=0),
    "qwen3": dict(SHAPE, head_dim=12),
    "gpt2": dict(
        vocab_size=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        n_inner=48,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-6,
    ),
    "mixtral": dict(SHAPE, num_local_experts=3, num_experts_per_tok=1, router_aux_loss_coef=0.01),
    "qwen2_moe": dict(
        SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=36,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    "qwen3_moe": dict(SHAPE, head_dim=12, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=20),
}
"""Each supported model type, tiny; the config.json written from it is the one shortened."""
SAVED_ONLY = ("architectures", "dtype")
"""Fields save_pretrained adds to the config's own JSON."""


def saved_fields(kind: str) -> list[str]:
    config = transformers.AutoConfig.for_model(kind, **FULL[kind])
    return sorted(set(json.loads(config.to_json_string())) | set(SAVED_ONLY))


CASES = [(kind, field) for kind in FULL for field in saved_fields(kind)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> a folder with transformers' config.json and random weights of that tiny model, and the
    layout of those weights (made once)."""
    made = {}

    def folder_and_layout(kind: str):
        if kind not in made:
            config = transformers.AutoConfig.for_model(kind, **FULL[kind])
            folder = tmp_path_factory.mktemp(f"full-{kind}")
            save_random_hf_model(transformers.AutoModelForCausalLM.from_config, config, folder)
            made[kind] = folder, weight_layout(transformers.AutoConfig.from_pretrained(folder))
        return made[kind]

    return folder_and_layout


def short_copy(saved_folder, tmp_path_factory, leave_out: str):
    """A folder whose config.json is the saved one less `leave_out`, beside the same weights. (Its path
    names no model type: transformers would guess one from the path when the file has none.)"""
    folder = tmp_path_factory.mktemp("short")
    config = json.loads((saved_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != leave_out}))
    (folder / "model.safetensors").symlink_to(saved_folder / "model.safetensors")
    return folder


def transformers_reading(folder):
    """The config transformers makes of a folder's config.json, or None where it refuses the file."""
    try:
        return transformers.AutoConfig.from_pretrained(folder)
    except Exception:  # transformers' refusals take several types
        return None


def weight_layout(config) -> tuple[bool, dict[str, tuple[int, ...]]]:
    """Whether transformers ties the output layer to the embedding, and the shape of every weight of the
    model it builds from `config` (on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return config.tie_word_embeddings, {name: tuple(t.shape) for name, t in model.state_dict().items()}


def fits(reference, full_layout) -> bool:
    """Whether the model transformers builds from the short file takes the saved weights."""
    if reference is None:
        return False
    try:
        return weight_layout(reference) == full_layout
    except Exception:  # transformers cannot build the model the short file describes
        return False


def one_line_naming(message: str, folder, field: str) -> bool:
    return (
        "\n" not in message
        and message.startswith(f"{folder / 'config.json'}: ")
        and bool(re.search(rf"\b{field}\b", message))
    )


@pytest.mark.parametrize(("kind", "field"), CASES, ids=[f"{kind}-{field}" for kind, field in CASES])
def test_each_field_left_out_reads_as_transformers_or_is_named(saved, tmp_path_factory, kind, field):
    full_folder, full_layout = saved(kind)
    folder = short_copy(full_folder, tmp_path_factory, field)
    reference = transformers_reading(folder)
    if fits(reference, full_layout):
        model = model_from_hf(folder)
        assert model.config == config_for_hf(reference.to_dict(), "transformers' reading").model
    else:
        with pytest.raises(CheckpointError) as error:
            model_from_hf(folder)
        assert one_line_naming(str(error.value), folder, field), str(error.value)


def test_every_field_of_a_saved_config_is_left_out_once(saved):
    for kind in FULL:
        written = json.loads((saved(kind)[0] / "config.json").read_text())
        assert sorted(written) == saved_fields(kind)


@pytest.mark.parametrize(
    ("kind", "field", "default"),
    [("llama", "hidden_size", "hidden_size=4096"), ("gpt2", "n_head", "n_head=12"), ("llama", "model_type", None)],
)
def test_the_command_line_names_the_field_in_one_line(saved, tmp_path_factory, capsys, kind, field, default):
    folder = short_copy(saved(kind)[0], tmp_path_factory, field)
    out = folder.parent / f"{folder.name}-converted"
    assert main(["convert", "--from", "hf", str(folder), "--to", "paratron", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and one_line_naming(err.removeprefix("error: ").strip(), folder, field), err
    assert default is None or default in err  # transformers' default, shown as the cause
    assert not out.exists()  # nothing half-written


def test_a_missing_model_type_is_hinted_from_the_architectures(saved, tmp_path_factory):
    folder = short_copy(saved("qwen2")[0], tmp_path_factory, "model_type")
    with pytest.raises(CheckpointError, match=r'has no model_type .*; add "model_type": "qwen2" \(its architectures'):
        model_from_hf(folder)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"num_hidden_layers": "2"}, 'num_hidden_layers is "2", not a whole number; correct it'),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings is 1, not true or false; correct it"),
        ({"rms_norm_eps": True}, "rms_norm_eps is true, not a number; correct it"),
        ({"rope_parameters": [50000.0]}, "rope_parameters is not a JSON object of rotary settings; correct it"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_in_one_line(saved, tmp_path, change, expected):
    config = json.loads((saved("llama")[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, **change)))
    with pytest.raises(CheckpointError) as error:
        model_from_hf(tmp_path)
    assert str(error.value) == f"{tmp_path / 'config.json'}: {expected}"
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json: not a JSON object of model settings"):
        model_from_hf(tmp_path)


def test_older_files_with_a_top_level_rope_theta_read_as_transformers_reads_them():
    for kind in ("llama", "mixtral"):
        config = dict(FULL[kind], model_type=kind)
        for short in (config, {k: v for k, v in config.items() if k != "rope_theta"}):
            reference = transformers.AutoConfig.for_model(**short).to_dict()
            assert model_settings(short)["rotary_base"] == model_settings(reference)["rotary_base"]
    assert model_settings(dict(FULL["mixtral"], model_type="mixtral"))["rotary_base"] == 50000.0
    left_out = {k: v for k, v in FULL["mixtral"].items() if k != "rope_theta"}
    assert model_settings(dict(left_out, model_type="mixtral"))["rotary_base"] == 1e6  # Mixtral's own default


def test_convert_help_lists_every_supported_family(capsys):
    families = ["Llama", "Mistral", "Qwen2", "Qwen3", "GPT-2", "Mixtral", "Qwen2-MoE", "Qwen3-MoE", "LLaVA"]
    assert len(families) == len(ARCHITECTURES)
    with pytest.raises(SystemExit) as done:
        main(["convert", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(re.search(rf"\b{re.escape(name)}\b", text) for name in families), text


def write_weights_case(folder, case: str, good: bytes) -> str:
    """Damage `folder`'s weights as `case` says; return the file the message must name."""
    weights = folder / "model.safetensors"
    weights.unlink()
    if case == "missing":
        return str(folder)
    if case == "bin-only":
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
        return str(folder)
    if case == "index-names-a-missing-shard":
        index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return str(folder / "model.safetensors.index.json")
    if case == "index-places-a-tensor-elsewhere":
        weights.write_bytes(good)
        index = {"metadata": {}, "weight_map": {"model.not_there.weight": "model.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return str(weights)
    content = {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "text": b"these are not the weights\n" * 10,
        "lfs-pointer": b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1234\n",
    }[case]
    weights.write_bytes(content)
    return str(weights)


WEIGHT_CASES = {
    "missing": "no weights",
    "bin-only": "has PyTorch .bin weights only",
    "empty": "is empty (0 bytes)",
    "truncated": "is cut short",
    "text": "is not a safetensors file",
    "lfs-pointer": "is a Git LFS pointer",
    "index-names-a-missing-shard": "names model-00002-of-00002.safetensors, which is not in",
    "index-places-a-tensor-elsewhere": "has no tensor model.not_there.weight",
}


def test_damaged_or_missing_weights_are_one_line_naming_the_file(saved, tmp_path_factory, capsys):
    good = (saved("llama")[0] / "model.safetensors").read_bytes()
    for case, expected in WEIGHT_CASES.items():
        folder = tmp_path_factory.mktemp("weights")
        (folder / "config.json").write_text((saved("llama")[0] / "config.json").read_text())
        (folder / "model.safetensors").write_bytes(good)
        named = write_weights_case(folder, case, good)
        if case in ("empty", "index-names-a-missing-shard"):  # through the command line: exit code 2, one line
            out = folder / "converted"
            assert main(["convert", "--from", "hf", str(folder), "--to", "paratron", str(out)]) == 2, case
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(f"error: {named}: ") and expected in err, err
            assert not out.exists()
            continue
        with pytest.raises(CheckpointError) as error:
            model_from_hf(folder)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{named}: ") and expected in message, (case, message)


def test_sharded_weights_are_read_through_their_index(saved, tmp_path):
    reference = save_random_hf_model(
        transformers.LlamaForCausalLM, transformers.AutoConfig.for_model("llama", **FULL["llama"]), tmp_path / "one"
    )
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (tmp_path / "sharded" / "stale.safetensors").write_bytes(b"")  # not in the index: not read
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model_from_hf(tmp_path / "sharded")(ids) - reference(ids).logits).abs().max() < 1e-4
