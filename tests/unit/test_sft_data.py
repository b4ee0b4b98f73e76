"""Supervised fine-tuning data: line forms, chat templates, the assistant-token mask (checked
against transformers), truncation, packing, the preprocessed form and the sample order."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import AddedToken

from paratron.data.indexed import IndexedDataset
from paratron.data.sft import (
    IGNORE_INDEX,
    ChatTemplate,
    ConversationStore,
    SFTDataset,
    TokenizedConversation,
    load_chat_template,
    pack_bins,
    preprocess_sft,
    sft_dataset_exists,
    tokenize_conversation,
    tokenize_file,
    write_sft_dataset,
)
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe
from paratron.errors import DataError

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEXTS = ["Capital of France? Paris. Capital of Germany? Berlin. Be brief.", "Botty says hi, Botty. Botty Botty"] * 30
MULTI_TURN = [
    {"role": "system", "content": "Be brief"},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "Germany?"},
    {"role": "assistant", "content": "Berlin"},
]
LINES = [  # every line form; each conversation as its messages
    {"messages": MULTI_TURN},
    {"prompt": "Capital of France?", "completion": "Paris", "system": "Be brief"},
    {"instruction": "Capital of", "input": "France?", "output": "Paris"},
    {"instruction": "Capital of France?", "output": "Paris"},
]
CHATML_GENERATION = (  # chatml, with transformers' generation tag around exactly what we train on
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GLUED = CHATML_GENERATION.replace("assistant\\n", "Bot")  # the turn starts inside the token "Botty"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    bpe = train_byte_level_bpe(iter(TEXTS), vocab_size=400)
    bpe.hf.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return Tokenizer(bpe.hf, "test")


def _runs(conv: TokenizedConversation, tok: Tokenizer, trained: bool) -> list[str]:
    """The decoded text of each run of trained (or untrained) tokens."""
    marks = np.concatenate([[False], conv.trained == trained, [False]])
    edges = np.flatnonzero(np.diff(marks.astype(np.int8)))
    return [tok.decode(conv.ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


def _write(path, lines) -> None:
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))


# ---------------------------------------------------------------- the assistant-token mask


CHATML_TRAINED = [["Paris<|im_end|>\n", "Berlin<|im_end|>\n"]] + [["Paris<|im_end|>\n"]] * 3
LLAMA_TRAINED = [["Paris<|eot_id|>", "Berlin<|eot_id|>"]] + [["Paris<|eot_id|>"]] * 3


@pytest.mark.parametrize("spec, trained", [("chatml", CHATML_TRAINED), ("llama3", LLAMA_TRAINED)])
def test_trained_tokens_are_exactly_the_assistant_turns(tok, tmp_path, spec, trained):
    _write(tmp_path / "chat.jsonl", LINES[:2] + [""] + LINES[2:])  # a blank line is skipped, not counted
    template = load_chat_template(spec, None, bos_token="<|begin_of_text|>")
    convs = tokenize_file(tmp_path / "chat.jsonl", template, tok)
    assert [c.where for c in convs] == [f"{tmp_path / 'chat.jsonl'}:{n}" for n in (1, 2, 4, 5)]
    assert [_runs(c, tok, True) for c in convs] == trained
    assert all(c.ids.dtype == np.int32 and c.trained.dtype == bool for c in convs)
    if spec == "chatml":
        assert _runs(convs[0], tok, False) == [
            "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
            "<|im_start|>assistant\n",
            "<|im_start|>user\nGermany?<|im_end|>\n<|im_start|>assistant\n",
        ]
        assert _runs(convs[2], tok, False) == [
            "<|im_start|>user\nCapital of\n\nFrance?<|im_end|>\n<|im_start|>assistant\n"
        ]
        assert _runs(convs[3], tok, False) == [
            "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
        ]
    else:
        assert _runs(convs[1], tok, False) == [
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ]


def test_tokenizer_folder_template(tok, tmp_path):
    tok.save(tmp_path / "tokenizer.json")
    zephyr = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
    zephyr += "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    config = {"chat_template": zephyr, "eos_token": {"content": "<|endoftext|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template("tokenizer", tmp_path / "tokenizer.json", eos_token="<|eot_id|>")
    assert template.special_tokens == {"eos_token": "<|endoftext|>"}  # the tokenizer's own wins
    conv = tokenize_conversation(MULTI_TURN, template, tok, "x:1")
    assert _runs(conv, tok, True) == ["Paris<|endoftext|>\n", "Berlin<|endoftext|>\n"]
    assert _runs(conv, tok, False)[1] == "<|user|>\nGermany?<|endoftext|>\n<|assistant|>\n"

    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template("tokenizer", tmp_path, None, None).source == "D"
    (tmp_path / "chat_template.jinja").write_text("J")  # the file beside tokenizer.json comes first
    assert load_chat_template("tokenizer", tmp_path, None, None).source == "J"


@pytest.mark.parametrize("source", [CHATML_GENERATION, GLUED])
def test_mask_agrees_with_transformers(tok, source):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf)
    messages = [dict(m) for m in MULTI_TURN]
    messages[2]["content"] = "ty says hi" if source is GLUED else "Paris"
    theirs = hf.apply_chat_template(
        messages, chat_template=source, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    mine = tokenize_conversation(messages, ChatTemplate("t", source), tok, "x:1")
    assert mine.ids.tolist() == list(theirs["input_ids"])
    assert mine.trained.astype(int).tolist() == list(theirs["assistant_masks"])
    if source is GLUED:  # the token "Botty" holds the turn's first character, so it is trained
        assert "Botty" in _runs(mine, tok, True)[0]
    else:  # the built-in chatml marks the same tokens
        chatml = tokenize_conversation(messages, load_chat_template("chatml"), tok, "x:1")
        assert chatml.trained.tolist() == mine.trained.tolist()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not an object"),
        ({"text": "hi"}, "no 'messages', 'prompt' or 'instruction' key"),
        ({"prompt": "hi"}, "no 'completion' key"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn, so nothing to train on"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "role 'bot'; the roles are system, user, assistant"),
        ({"messages": ["hi"]}, "message 1 is not an object with string 'role' and 'content'"),
        ({"prompt": "hi", "completion": 3}, "'completion' is a int; it must be a string"),
    ],
)
def test_bad_lines_name_file_and_line(tok, tmp_path, line, message):
    _write(tmp_path / "bad.jsonl", [LINES[1], line])
    with pytest.raises(DataError, match=f"bad.jsonl:2: .*{message}"):
        tokenize_file(tmp_path / "bad.jsonl", load_chat_template("chatml"), tok)


def test_invalid_utf8_names_file_and_line(tok, tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(json.dumps(LINES[1]).encode() + b'\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: byte 12 of the line is not valid UTF-8"):
        tokenize_file(tmp_path / "bad.jsonl", load_chat_template("chatml"), tok)
    with pytest.raises(DataError, match="absent.jsonl: no such file"):
        tokenize_file(tmp_path / "absent.jsonl", load_chat_template("chatml"), tok)


def test_template_errors(tok, tmp_path):
    _write(tmp_path / "chat.jsonl", [LINES[3], LINES[1]])
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    with pytest.raises(DataError, match="chat.jsonl:2: the chat template failed to render: no system role"):
        tokenize_file(tmp_path / "chat.jsonl", load_chat_template(str(tmp_path / "t.jinja")), tok)
    counting = ChatTemplate("counting", "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(DataError, match="x:7: the chat template does not render conversations prefix by prefix"):
        tokenize_conversation(MULTI_TURN, counting, tok, "x:7")
    with pytest.raises(DataError, match="--chat-template .*missing.jinja: no such file; pass --chat-template chatml"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(DataError, match="--chat-template broken: jinja syntax error at line 1"):
        ChatTemplate("broken", "{% for m in messages %}")
    tok.save(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="has no chat template .*pass --chat-template chatml, llama3"):
        load_chat_template("tokenizer", tmp_path, None, None)


# ---------------------------------------------------------------- truncation and packing


def _conv(ids, trained, where="") -> TokenizedConversation:
    return TokenizedConversation(np.array(ids, np.int32), np.array(trained, bool), where)


A = _conv([1, 2, 3], [0, 1, 1])
B = _conv([4, 5, 6, 7], [0, 0, 1, 1])
LONG = _conv([10, 11, 12, 13, 14, 15], [0, 0, 0, 1, 1, 1], "long.jsonl:9")


def test_packed_sample_layout():
    ds = SFTDataset([A, B], seq_length=8, pad_id=0, pack=True, num_samples=None, seed=0, truncation="error", name="t")
    assert len(ds) == 1 and ds.trained_tokens_per_epoch == 4 and ds.truncated == 0
    sample = ds[0]
    assert sample.input_ids.tolist() == [1, 2, 4, 5, 6, 0, 0, 0]
    assert sample.labels.tolist() == [2, 3, -100, 6, 7, -100, -100, -100]
    assert sample.position_ids.tolist() == [0, 1, 0, 1, 2, 0, 1, 2]
    assert sample.segment_ids.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert all(a.dtype == np.int64 for a in sample)
    unpacked = SFTDataset([A, B], 4, 99, pack=False, num_samples=None, seed=0, truncation="error", name="t")
    assert [s.input_ids.tolist() for s in (unpacked[0], unpacked[1])] == [[1, 2, 99, 99], [4, 5, 6, 99]]
    assert unpacked[0].segment_ids.tolist() == [0, 0, 1, 1] and unpacked[0].position_ids.tolist() == [0, 1, 0, 1]


def test_truncation():
    ds = SFTDataset([LONG, A], 3, 0, pack=False, num_samples=None, seed=0, truncation="truncate", name="t")
    assert ds.truncated == 1 and ds.trained_tokens_per_epoch == 1 + 2
    assert ds[0].input_ids.tolist() == [10, 11, 12] and ds[0].labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 13]
    with pytest.raises(DataError, match="long.jsonl:9: 6 tokens do not fit .*--seq-length 3.*--sft-truncation"):
        SFTDataset([A, LONG], 3, 0, pack=True, num_samples=None, seed=0, truncation="error", name="t")
    fits = SFTDataset([LONG], 5, 0, pack=True, num_samples=None, seed=0, truncation="error", name="t")
    assert fits[0].labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 13, 14, 15]


def _best_fit_reference(lengths, capacity):
    rooms, bins = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fitting = [b for b in range(len(bins)) if rooms[b] >= lengths[i]]
        if fitting:
            b = min(fitting, key=lambda b: (rooms[b], b))
        else:
            b = len(bins)
            bins.append([])
            rooms.append(capacity)
        bins[b].append(i)
        rooms[b] -= lengths[i]
    return [sorted(b) for b in bins]


def test_pack_bins():
    assert [b.tolist() for b in pack_bins(np.array([5, 4, 3, 3, 2, 1]), 8)] == [[0, 2], [1, 3, 5], [4]]
    rng = np.random.default_rng(0)
    for capacity in (16, 100):
        lengths = rng.integers(1, capacity + 1, size=300)
        bins = pack_bins(lengths, capacity)
        assert sorted(np.concatenate(bins).tolist()) == list(range(300))
        assert max(lengths[b].sum() for b in bins) <= capacity
        assert [b.tolist() for b in bins] == _best_fit_reference(lengths.tolist(), capacity)


def _pairs(samples) -> list:
    """Each conversation's (inputs, labels) in a sample; padding (inputs 0, no labels) left out."""
    out = []
    for s in samples:
        for seg in range(int(s.segment_ids.max()) + 1):
            keep = s.segment_ids == seg
            if not (np.all(s.input_ids[keep] == 0) and np.all(s.labels[keep] == IGNORE_INDEX)):
                out.append((tuple(s.input_ids[keep]), tuple(s.labels[keep])))
    return sorted(out)


def test_packed_and_unpacked_hold_the_same_pairs(tok):
    template = load_chat_template("chatml")
    convs = [tokenize_conversation(messages, template, tok, "x") for messages in (MULTI_TURN, MULTI_TURN[1:3])] * 5
    seq = max(len(c.ids) for c in convs)  # room for padding after every conversation
    packed = SFTDataset(convs, seq, 0, pack=True, num_samples=None, seed=0, truncation="error", name="t")
    unpacked = SFTDataset(convs, seq, 0, pack=False, num_samples=None, seed=0, truncation="error", name="t")
    assert len(packed) < len(unpacked) == 10
    assert _pairs(packed[k] for k in range(len(packed))) == _pairs(unpacked[k] for k in range(10))
    assert packed.trained_tokens_per_epoch == unpacked.trained_tokens_per_epoch > 0


# ---------------------------------------------------------------- preprocessed form and sample order


def test_write_and_read_back(tok, tmp_path):
    _write(tmp_path / "a.jsonl", LINES[:2])
    _write(tmp_path / "b.jsonl", LINES[2:])
    template = load_chat_template("chatml")
    prefix = str(tmp_path / "out" / "sft")
    assert not sft_dataset_exists(prefix)
    convs = tokenize_file(tmp_path / "a.jsonl", template, tok) + tokenize_file(tmp_path / "b.jsonl", template, tok)
    assert preprocess_sft([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], prefix, template, tok) == (
        4,
        sum(len(c.ids) for c in convs),
    )
    assert sft_dataset_exists(prefix)
    assert IndexedDataset(f"{prefix}_trained_document").dtype == np.uint8
    store = ConversationStore(prefix)
    assert len(store) == 4
    for mine, stored in zip(convs, store):
        assert stored.ids.tolist() == mine.ids.tolist() and stored.trained.tolist() == mine.trained.tolist()
    args = dict(seq_length=64, pad_id=0, pack=True, num_samples=9, seed=3, truncation="truncate", name="t")
    from_list, from_store = SFTDataset(convs, **args), SFTDataset(store, **args)
    assert all(np.array_equal(a, b) for k in range(9) for a, b in zip(from_list[k], from_store[k]))
    assert (
        from_list.trained_tokens_per_epoch
        == from_store.trained_tokens_per_epoch
        == sum(int(c.trained[1:].sum()) for c in convs)
    )


def test_interrupted_write_leaves_nothing(tmp_path):
    def failing():
        yield A
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_sft_dataset(failing(), str(tmp_path / "sft"))
    assert list(tmp_path.iterdir()) == []
    assert write_sft_dataset([A, B], str(tmp_path / "sft")) == (2, 7)


def test_sample_order_is_a_function_of_seed_and_index():
    convs = [_conv([i, i + 1], [0, 1]) for i in range(5)]

    def dataset(num_samples, seed):
        return SFTDataset(convs, 1, 0, pack=False, num_samples=num_samples, seed=seed, truncation="error", name="t")

    one_epoch = dataset(None, 0)
    assert len(one_epoch) == 5 and [int(one_epoch[k].input_ids[0]) for k in range(5)] == [0, 1, 2, 3, 4]
    ds = dataset(12, 7)
    order = [int(ds[k].input_ids[0]) for k in range(12)]
    expected = [int(i) for e in range(3) for i in np.random.RandomState(7 + e).permutation(5)][:12]
    assert len(ds) == 12 and order == expected
    assert [int(dataset(12, 7)[k].input_ids[0]) for k in reversed(range(12))] == order[::-1]  # any access order
    with pytest.raises(IndexError):
        ds[12]
