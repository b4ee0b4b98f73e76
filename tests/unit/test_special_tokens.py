"""Special tokens come from what a tokenizer's folder declares (tokenizer_config.json, the model's
generation_config.json and config.json), checked against transformers; they survive conversion
to paratron and back, saving and passing to other processes, and drive chat templates, SFT
padding and where `generate` stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # the reference; installed with the test extras
from safetensors.torch import save_file
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from paratron.checkpoint.pretrained import tokenizer_from_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.cli import main
from paratron.config import build_config
from paratron.data.sft import tokenizer_chat_template
from paratron.data.sft.sources import whole_tasks
from paratron.data.tokenizer import Tokenizer, tokenizer_from_spec

WORDS = ["<unk>", "alpha", "beta", "gamma", "hello", "user", "assistant", "system"]
SPECIALS = [
    "</s>",  # a name the old guess knew: declarations must win over it
    "<|end|>",
    "<|eot|>",
    "<|turn|>",
    "<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>",
    "<|pad_here|>",
    "<|im_start|>",
    "<|im_end|>",
]
ID = {token: i for i, token in enumerate(WORDS + SPECIALS)}
DEEPSEEK_EOS = {  # as tokenizer_config.json writes an AddedToken
    "__type": "AddedToken",
    "content": "<｜end▁of▁sentence｜>",
    "lstrip": False,
    "normalized": False,
    "rstrip": False,
    "single_word": False,
    "special": True,
}
TURNS = (
    "{% for m in messages %}{{ m.role }} {{ m.content }} <|turn|> {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
"""A chat template whose turns end with <|turn|>, a token no tokenizer setting names."""


def tokenizer_folder(folder: Path, files: dict[str, dict] | None = None) -> Path:
    """A word-level tokenizer.json (WORDS, then SPECIALS as special tokens) and the given JSON files."""
    folder.mkdir(parents=True, exist_ok=True)
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    hf.save(str(folder / "tokenizer.json"))
    for name, values in (files or {}).items():
        (folder / name).write_text(json.dumps(values), encoding="utf-8")
    return folder


def hf_model_folder(folder: Path, files: dict[str, dict], successor: dict[str, str] | None = None) -> Path:
    """A one-layer Llama whose greedy next token depends only on the last one (`successor`, by token;
    others lead to <unk>), with the tokenizer and `files`; config.json gets the model's settings."""
    hidden, vocab = 32, len(ID)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        **files.get("config.json", {}),
    }
    tokenizer_folder(folder, {**files, "config.json": config})
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
        "model.layers.0.input_layernorm.weight": (hidden,),
        "model.layers.0.post_attention_layernorm.weight": (hidden,),
        "model.layers.0.self_attn.q_proj.weight": (hidden, hidden),
        "model.layers.0.self_attn.k_proj.weight": (hidden // 2, hidden),
        "model.layers.0.self_attn.v_proj.weight": (hidden // 2, hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, hidden),
        "model.layers.0.mlp.gate_proj.weight": (64, hidden),
        "model.layers.0.mlp.up_proj.weight": (64, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, 64),
    }
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    for name in tensors:  # attention and MLP add nothing: the last token's embedding alone decides
        if name.endswith("norm.weight"):
            tensors[name].fill_(1.0)
    for axis, (token, following) in enumerate((successor or {}).items()):
        tensors["model.embed_tokens.weight"][ID[token], axis] = 1.0
        tensors["lm_head.weight"][ID[following], axis] = 1.0
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def reference(folder: Path) -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder)


# ---------------------------------------------------------------- reading declarations


@pytest.mark.parametrize("eos", ["<|end|>", "<｜end▁of▁sentence｜>", DEEPSEEK_EOS])
def test_end_tokens_in_no_list_are_read_from_tokenizer_config(tmp_path, eos):
    config = {"eos_token": eos, "pad_token": "<|pad_here|>", "bos_token": "<｜begin▁of▁sentence｜>"}
    folder = tokenizer_folder(tmp_path, {"tokenizer_config.json": config})
    tokenizer, expected = Tokenizer.from_file(folder), reference(folder)
    assert tokenizer.eod_id == expected.eos_token_id
    assert (tokenizer.pad_id, tokenizer.bos_id) == (expected.pad_token_id, expected.bos_token_id)
    assert tokenizer.stop_ids == (expected.eos_token_id,)


@pytest.mark.parametrize("file", ["generation_config.json", "config.json"])
def test_ids_declared_by_the_model_configuration(tmp_path, file):
    declared = {"eos_token_id": [ID["<|end|>"], ID["<|eot|>"]], "pad_token_id": ID["<|pad_here|>"],
                "bos_token_id": ID["<｜begin▁of▁sentence｜>"]}  # fmt: skip
    files = {file: {"model_type": "llama", **declared}}
    if file == "generation_config.json":  # it comes before config.json, as for transformers' generate
        files["config.json"] = {"model_type": "llama", "eos_token_id": ID["</s>"], "bos_token_id": 1}
    folder = tokenizer_folder(tmp_path, files)
    if file == "config.json":
        expected = transformers.AutoConfig.from_pretrained(folder)
    else:
        expected = transformers.GenerationConfig.from_pretrained(folder)
    tokenizer = Tokenizer.from_file(folder)
    assert list(tokenizer.stop_ids) == expected.eos_token_id == [ID["<|end|>"], ID["<|eot|>"]]
    assert tokenizer.eod_id == expected.eos_token_id[0]
    assert (tokenizer.pad_id, tokenizer.bos_id) == (expected.pad_token_id, expected.bos_token_id)


def test_a_negative_id_declares_no_token(tmp_path):
    """Some Llama configs say pad_token_id -1 for "no padding token": that is no declaration."""
    files = {"config.json": {"model_type": "llama", "eos_token_id": ID["<|end|>"], "pad_token_id": -1}}
    tokenizer = Tokenizer.from_file(tokenizer_folder(tmp_path, files))
    assert (tokenizer.eod_id, tokenizer.pad_id) == (ID["<|end|>"], ID["<|end|>"])  # (padding with the end token)


def test_nothing_declared_falls_back_to_the_usual_names(tmp_path, capsys):
    tokenizer = Tokenizer.from_file(tokenizer_folder(tmp_path / "guessed"))
    assert (tokenizer.eod_id, tokenizer.pad_id, tokenizer.bos_id) == (ID["</s>"], ID["</s>"], None)
    assert tokenizer.stop_ids == (ID["</s>"],)
    bare = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    (tmp_path / "bare").mkdir()
    bare.save(str(tmp_path / "bare" / "tokenizer.json"))
    (tmp_path / "text.txt").write_text("alpha beta")
    args = ["--input", str(tmp_path / "text.txt"), "--output-prefix", str(tmp_path / "out")]
    assert main(["preprocess", *args, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 str(tmp_path / "bare")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "declare the tokenizer's eos_token in tokenizer_config.json" in err, err


@pytest.mark.parametrize(
    "file, values, named",
    [
        ("tokenizer_config.json", {"eos_token": "<|nope|>"}, "eos_token '<|nope|>' is not in the vocabulary"),
        ("special_tokens_map.json", {"pad_token": {"content": "<|nope|>"}}, "pad_token '<|nope|>' is not in"),
        ("config.json", {"eos_token_id": [ID["<|end|>"], 999]}, "eos_token_id 999 is not a token id"),
        ("generation_config.json", {"bos_token_id": "one"}, "bos_token_id 'one' is not a token id"),
    ],
)
def test_a_declared_token_missing_from_the_vocabulary_is_one_line(tmp_path, capsys, file, values, named):
    folder = tokenizer_folder(tmp_path / "tok", {file: values})
    (tmp_path / "text.txt").write_text("alpha beta")
    args = ["--input", str(tmp_path / "text.txt"), "--output-prefix", str(tmp_path / "out")]
    args += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder)]
    assert main(["preprocess", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {folder / file}: {named}"), err
    assert not list(tmp_path.glob("out*"))


# ---------------------------------------------------------------- keeping them


def test_saved_and_passed_tokenizers_keep_the_declaration(tmp_path):
    declared = {"eos_token_id": [ID["<|end|>"], ID["<|eot|>"]], "bos_token_id": ID["<｜begin▁of▁sentence｜>"]}
    tokenizer = Tokenizer.from_file(tokenizer_folder(tmp_path / "hf", {"config.json": declared}))
    (tmp_path / "saved").mkdir()
    tokenizer.save(tmp_path / "saved" / "tokenizer.json")
    for again in (Tokenizer.from_file(tmp_path / "saved"), tokenizer_from_spec(tokenizer.spec())):
        assert (again.eod_id, again.pad_id, again.bos_id) == (ID["<|end|>"], ID["<|end|>"], tokenizer.bos_id)
        assert again.stop_ids == (ID["<|end|>"], ID["<|eot|>"])


DECLARED_IN_TOKENIZER_CONFIG = {
    "tokenizer_config.json": {
        "eos_token": DEEPSEEK_EOS,
        "bos_token": "<｜begin▁of▁sentence｜>",
        "pad_token": "<|pad_here|>",
        "chat_template": TURNS,
    },
    "generation_config.json": {
        "eos_token_id": [ID["<｜end▁of▁sentence｜>"], ID["<|eot|>"]],
        "bos_token_id": ID["<｜begin▁of▁sentence｜>"],
    },
}
DECLARED_IN_CONFIG = {
    "config.json": {
        "eos_token_id": [ID["<|end|>"], ID["<|eot|>"]],
        "bos_token_id": ID["<｜begin▁of▁sentence｜>"],
        "pad_token_id": ID["<|pad_here|>"],
    }
}


def generation_config(folder: Path) -> transformers.GenerationConfig:
    if (folder / "generation_config.json").is_file():
        return transformers.GenerationConfig.from_pretrained(folder)
    return transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(folder))


def declared(folder: Path) -> tuple[int, int, int | None, tuple[int, ...]]:
    """(end of document, padding, beginning, stop ids) of a Hugging Face folder as transformers reads
    its files: the tokenizer's special tokens first, then the generation config's ids."""
    tokens, generation = reference(folder), generation_config(folder)
    listed = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    eos = tokens.eos_token_id if tokens.eos_token_id is not None else listed[0]
    pad = next((i for i in (tokens.pad_token_id, generation.pad_token_id) if i is not None), eos)
    bos = tokens.bos_token_id if tokens.bos_token_id is not None else generation.bos_token_id
    return eos, pad, bos, tuple(dict.fromkeys([eos, *(i for i in listed if i is not None)]))


@pytest.mark.parametrize(
    "files, stops",
    [
        (DECLARED_IN_TOKENIZER_CONFIG, ("<｜end▁of▁sentence｜>", "<|eot|>")),
        (DECLARED_IN_CONFIG, ("<|end|>", "<|eot|>")),
    ],
    ids=["tokenizer", "model"],
)
def test_conversion_to_paratron_and_back_keeps_the_declaration(tmp_path, files, stops):
    source = hf_model_folder(tmp_path / "hf", files)
    assert main(["convert", "--from", "hf", str(source), "--to", "paratron", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--from", "paratron", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "back")]) == 0
    expected = declared(source)
    assert expected[3] == tuple(ID[t] for t in stops)
    converted = tokenizer_from_checkpoint(read_checkpoint(tmp_path / "ckpt"))  # as generate, train and evaluate load it
    exported = Tokenizer.from_file(tmp_path / "back")
    for tokenizer in (converted, exported):
        assert (tokenizer.eod_id, tokenizer.pad_id, tokenizer.bos_id, tokenizer.stop_ids) == expected
    assert declared(tmp_path / "back") == expected
    assert generation_config(tmp_path / "back").eos_token_id == generation_config(source).eos_token_id
    model_config = transformers.AutoConfig.from_pretrained(tmp_path / "back")  # (not transformers' Llama defaults)
    assert model_config.eos_token_id in (expected[0], list(expected[3]))
    assert (model_config.pad_token_id, model_config.bos_token_id) == expected[1:3]


def test_conversion_refuses_a_bad_declaration_before_writing(tmp_path, capsys):
    source = hf_model_folder(tmp_path / "hf", {"tokenizer_config.json": {"eos_token": "<|nope|>"}})
    assert main(["convert", "--from", "hf", str(source), "--to", "paratron", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {source / 'tokenizer_config.json'}: eos_token '<|nope|>' is not in the vocabulary of " \
        f"{source / 'tokenizer.json'}; declare a token the tokenizer has, or add it to the tokenizer\n"  # fmt: skip
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------- using them


def test_chat_templates_see_the_declared_tokens(tmp_path):
    files = {
        "tokenizer_config.json": {"chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}"
                                  "{{ eos_token }}{% endfor %}"},
        "generation_config.json": {"bos_token_id": ID["<｜begin▁of▁sentence｜>"]},
        "config.json": {"eos_token_id": ID["<|end|>"]},
    }  # fmt: skip
    template = tokenizer_chat_template("tokenizer", Tokenizer.from_file(tokenizer_folder(tmp_path, files)))
    assert template.render([{"role": "user", "content": "hi"}]) == "<｜begin▁of▁sentence｜>hi<|end|>"


def test_a_declared_pad_token_pads_sft_samples(tmp_path):
    files = {"tokenizer_config.json": {"eos_token": "<|im_end|>", "pad_token": "<|pad_here|>"}}
    tokenizer = Tokenizer.from_file(tokenizer_folder(tmp_path / "tok", files))
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "alpha beta"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    config = build_config(dict(seq_length=16, chat_template="chatml", mock_data=True))
    sample = whole_tasks(config, tokenizer, [str(tmp_path / "chat.jsonl")], ["chat"])[0][0]
    used = 8  # <|im_start|> user hello <|im_end|> <|im_start|> assistant alpha beta (<|im_end|> is a label)
    assert sample.input_ids[used:].tolist() == [reference(tmp_path / "tok").pad_token_id] * (16 - used)
    assert sample.input_ids[used - 1] == ID["beta"] and sample.labels[used - 1] == ID["<|im_end|>"]


GENERATING = {
    "tokenizer_config.json": {"eos_token": "<|end|>", "chat_template": TURNS},
    "generation_config.json": {"eos_token_id": [ID["<|end|>"], ID["<|eot|>"]]},
}
CHAIN = {"alpha": "beta", "beta": "<|eot|>", "<|eot|>": "gamma", "assistant": "gamma", "gamma": "<|turn|>",
         "<|turn|>": "alpha"}  # fmt: skip
"""What the model says next: beta then a declared stop id after alpha; <|turn|> after the assistant's gamma."""


def test_generate_stops_at_the_declared_stop_ids(tmp_path, capsys):
    source = hf_model_folder(tmp_path / "hf", GENERATING, CHAIN)
    assert main(["convert", "--from", "hf", str(source), "--to", "paratron", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    common = ["generate", "--load", str(tmp_path / "ckpt"), "--max-new-tokens", "6"]
    assert main([*common, "--prompt", "alpha"]) == 0
    assert capsys.readouterr().out == "alphabeta\n"  # stopped at <|eot|>, the model config's second end token
    assert main([*common, "--prompt", "hello", "--chat-template", "tokenizer"]) == 0
    assert capsys.readouterr().out == "gamma\n"  # stopped at <|turn|>, where the template ends a turn
