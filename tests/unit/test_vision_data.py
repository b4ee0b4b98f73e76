"""Image-text data: LLaVA's files and the messages form
(placeholders expanded as Hugging Face's LLaVA processor does, checked against transformers),
bad input, samples with their pixels, and synthetic samples."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import AddedToken

from paratron.data.sft import IGNORE_INDEX, ChatTemplate, load_chat_template
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe
from paratron.data.vision import (
    ImageProcessor,
    ImageSettings,
    ImageTiling,
    MockVisionSamples,
    VisionSFTDataset,
    read_vision_file,
)
from paratron.data.vision.llava import encode_prompt
from paratron.errors import ConfigError, DataError

SPECIALS = ["<|im_start|>", "<|im_end|>", "<image>"]
TEXTS = ["What is in the picture? A red square. Describe both. Two squares, red and blue."] * 30
CHATML_GENERATION = (  # chatml, with transformers' generation tag around exactly what is trained
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
COLOURS = {"red.png": (255, 0, 0), "blue.png": (0, 0, 255), "green.png": (0, 160, 0)}
S = 16  # the encoder's image size
TOKENS = 3  # image tokens per image (per tile)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    bpe = train_byte_level_bpe(iter(TEXTS), vocab_size=300)
    bpe.hf.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return Tokenizer(bpe.hf, "test")


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    for name, colour in COLOURS.items():
        Image.new("RGB", (24, 20), colour).save(tmp_path / name)
    Image.new("RGB", (48, 16), (200, 100, 0)).save(tmp_path / "wide.png")
    return tmp_path


def _settings(tok: Tokenizer, tiling: ImageTiling | None = None, processor=None) -> ImageSettings:
    return ImageSettings(processor or ImageProcessor.siglip(S), tok.hf.token_to_id("<image>"), TOKENS, tiling)


def _write_json(path: Path, samples: list) -> None:
    path.write_text(json.dumps(samples, indent=2))  # a sample spans several lines


def _write_jsonl(path: Path, samples: list) -> None:
    path.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples), encoding="utf-8")


LLAVA = [
    {
        "id": "1",
        "image": "red.png",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is in the picture?"},
            {"from": "gpt", "value": "A red square."},
        ],
    },
    {
        "image": ["red.png", "blue.png"],
        "conversations": [
            {"from": "system", "value": "Describe both."},
            {"from": "human", "value": "<image> and <image>?"},
            {"from": "gpt", "value": "Two squares, red and blue."},
        ],
    },
    {"conversations": [{"from": "user", "value": "What is?"}, {"from": "assistant", "value": "A picture."}]},
]
MESSAGES = {
    "messages": [
        {"role": "user", "content": [{"type": "image", "image": "green.png"}, {"type": "text", "text": "What is?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
    ]
}


# ---------------------------------------------------------------- reading and tokenizing


def _expanded(messages: list[dict], counts: list[int]) -> list[dict]:
    """The messages as Hugging Face's LLaVA processor feeds them to the tokenizer: each image's
    placeholder repeated once per image embedding."""
    out, images = [], iter(counts)
    for message in messages:
        pieces = message["content"].split("<image>")
        content = pieces[0] + "".join("<image>" * next(images) + piece for piece in pieces[1:])
        out.append({"role": message["role"], "content": content})
    return out


def test_llava_file_agrees_with_transformers(tok, folder):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf)
    _write_json(folder / "llava.json", LLAVA)
    settings = _settings(tok)
    conversations = read_vision_file(folder / "llava.json", ChatTemplate("t", CHATML_GENERATION), tok, settings)
    starts = [n for n, line in enumerate((folder / "llava.json").read_text().splitlines(), 1) if line == "  {"]
    assert [c.where for c in conversations] == [f"{folder / 'llava.json'}:{n}" for n in starts]  # where each begins
    assert [[Path(r.path).name for r in c.images] for c in conversations] == [["red.png"], ["red.png", "blue.png"], []]
    for conversation, sample in zip(conversations, LLAVA):
        roles = {"human": "user", "gpt": "assistant"}
        messages = [{"role": roles.get(t["from"], t["from"]), "content": t["value"]} for t in sample["conversations"]]
        theirs = hf.apply_chat_template(
            _expanded(messages, [TOKENS] * len(conversation.images)),
            chat_template=CHATML_GENERATION,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert conversation.ids.tolist() == list(theirs["input_ids"])
        assert conversation.trained.astype(int).tolist() == list(theirs["assistant_masks"])
        assert np.count_nonzero(conversation.ids == settings.image_token_id) == TOKENS * len(conversation.images)


def test_messages_form_and_tiles(tok, folder):
    parts = [
        {"type": "text", "text": "Describe both."},
        {"type": "image", "image": "red.png"},
        {"type": "image", "path": "blue.png"},
    ]
    two = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Two squares."}]}
    _write_jsonl(folder / "chat.jsonl", [MESSAGES, two])
    wide = json.loads(json.dumps(MESSAGES))
    wide["messages"][0]["content"][0]["image"] = str(folder / "wide.png")  # an absolute path
    (folder / "sub").mkdir()
    _write_jsonl(folder / "sub" / "wide.jsonl", [wide])
    settings = _settings(tok, ImageTiling(6, use_thumbnail=True))
    template = load_chat_template("chatml")
    first, second = read_vision_file(folder / "chat.jsonl", template, tok, settings)
    (third,) = read_vision_file(folder / "sub" / "wide.jsonl", template, tok, settings)
    assert first.where.endswith("chat.jsonl:1") and second.where.endswith("chat.jsonl:2")
    texts = [tok.decode(c.ids.tolist()).replace("<image>" * TOKENS, "<I>") for c in (first, second)]
    assert texts == [
        "<|im_start|>user\n<I>\nWhat is?<|im_end|>\n<|im_start|>assistant\nA square.<|im_end|>\n",
        "<|im_start|>user\nDescribe both.\n<I>\n<I><|im_end|>\n<|im_start|>assistant\nTwo squares.<|im_end|>\n",
    ]
    assert [Path(r.path).name for r in second.images] == ["red.png", "blue.png"]
    assert [r.tiles for r in first.images] == [1]  # 24 x 20: 2 x 2 ties 1 x 1, but it is under half their area
    assert [r.tiles for r in third.images] == [4]  # 48 x 16: a 3 x 1 grid and the thumbnail
    assert np.count_nonzero(third.ids == settings.image_token_id) == 4 * TOKENS
    assert not third.trained[third.ids == settings.image_token_id].any()


LLAVA_PROCESSOR_TEMPLATE = (  # chatml over content parts, joined by newlines as the messages form reads them
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{% if p['type'] == 'image' %}{{ '<image>' }}{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
)


def test_samples_agree_with_transformers_llava_processor(tok, folder):
    """Token ids and pixel values as LlavaProcessor makes them (a CLIP processor, 8-pixel patches:
    4 image tokens per 16-pixel image)."""
    transformers = pytest.importorskip("transformers")
    clip = transformers.CLIPImageProcessorPil(size={"shortest_edge": S}, crop_size={"height": S, "width": S})
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf)
    llava = transformers.LlavaProcessor(clip, hf, patch_size=8, vision_feature_select_strategy="full")
    parts = [
        {"type": "image", "image": str(folder / "wide.png")},
        {"type": "text", "text": "Describe both."},
        {"type": "image", "image": str(folder / "green.png")},
    ]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "Two squares."}]
    theirs = llava.apply_chat_template(
        messages, chat_template=LLAVA_PROCESSOR_TEMPLATE, tokenize=True, return_dict=True, return_tensors="np"
    )
    _write_jsonl(folder / "chat.jsonl", [{"messages": messages}])
    settings = ImageSettings(ImageProcessor.from_dict(clip.to_dict()), tok.hf.token_to_id("<image>"), 4)
    conversations = read_vision_file(folder / "chat.jsonl", load_chat_template("chatml"), tok, settings)
    assert conversations[0].ids.tolist() == theirs["input_ids"][0].tolist()
    sample = VisionSFTDataset(conversations, settings, 64, tok.pad_id, False, None, 0, "error", "t")[0]
    np.testing.assert_allclose(sample.images.numpy(), theirs["pixel_values"], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- bad input


BAD = [
    ({"image": "absent.png", "conversations": LLAVA[0]["conversations"]}, "image .*absent.png does not exist"),
    ({"image": "notes.png", "conversations": LLAVA[0]["conversations"]}, "notes.png is not an image Pillow can read"),
    ({"image": "sub", "conversations": LLAVA[0]["conversations"]}, "image .*sub is a folder, not an image file"),
    ({"image": ["red.png", "blue.png"], "conversations": LLAVA[0]["conversations"]}, "1 <image> placeholder.* 2 im"),
    ({"image": "red.png", "conversations": LLAVA[2]["conversations"]}, "0 <image> placeholder"),
    ({"image": 3, "conversations": LLAVA[0]["conversations"]}, "'image' is 3; write a path or a list of paths"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, "turn 1 is from 'bot'; the speakers are human"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
    ({"text": "hi"}, "no 'conversations' or 'messages' key"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "a content part of message 1 is neither"),
    (
        {"messages": [{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "x"}]},
        "1 <image> placeholder.* but 0 image",
    ),
]


@pytest.mark.parametrize("sample, message", BAD)
def test_bad_samples_name_file_and_line(tok, folder, sample, message):
    (folder / "notes.png").write_text("not a picture")
    (folder / "sub").mkdir()
    _write_jsonl(folder / "bad.jsonl", [LLAVA[0], sample])
    with pytest.raises(DataError, match=f"bad.jsonl:2: .*{message}"):
        read_vision_file(folder / "bad.jsonl", load_chat_template("chatml"), tok, _settings(tok))


def test_bad_files(tok, folder):
    template, settings = load_chat_template("chatml"), _settings(tok)
    (folder / "broken.json").write_text('[\n  {"conversations": []},\n  {"oops"}\n]')
    with pytest.raises(DataError, match="broken.json:2: 'conversations' must be a non-empty list"):
        read_vision_file(folder / "broken.json", template, tok, settings)
    body = json.dumps(LLAVA[:1], indent=1)[:-1]  # without its closing ']'
    oops = body.count("\n") + 2
    (folder / "broken.json").write_text(body + '\n  {"oops"}\n]')
    with pytest.raises(DataError, match=f"broken.json:{oops}: expected ',' or ']' after a sample"):
        read_vision_file(folder / "broken.json", template, tok, settings)
    (folder / "broken.json").write_text(body + ',\n  {"oops"}\n]')
    with pytest.raises(DataError, match=f"broken.json:{oops}: not valid JSON"):
        read_vision_file(folder / "broken.json", template, tok, settings)
    with pytest.raises(DataError, match="--image-folder .*elsewhere: no such folder"):
        read_vision_file(folder / "broken.json", template, tok, settings, folder / "elsewhere")
    _write_jsonl(folder / "ok.jsonl", [LLAVA[0]])
    stranger = ImageSettings(settings.processor, tok.vocab_size + 5, TOKENS)
    with pytest.raises(DataError, match=f"image token id {tok.vocab_size + 5} is not in the tokenizer's vocabulary"):
        read_vision_file(folder / "ok.jsonl", template, tok, stranger)
    plain_token = ImageSettings(settings.processor, tok.hf.token_to_id("<|im_end|>"), TOKENS)
    with pytest.raises(DataError, match="ok.jsonl:1: the tokenized text holds 3 image token"):
        read_vision_file(folder / "ok.jsonl", template, tok, plain_token)


def test_a_broken_image_fails_when_drawn_naming_it(tok, folder):
    _write_jsonl(folder / "ok.jsonl", [LLAVA[0]])
    conversations = read_vision_file(folder / "ok.jsonl", load_chat_template("chatml"), tok, _settings(tok))
    data = (folder / "red.png").read_bytes()
    (folder / "red.png").write_bytes(data[: len(data) // 2])  # the header survives, the pixels do not
    dataset = VisionSFTDataset(conversations, _settings(tok), 64, tok.pad_id, False, None, 0, "error", "t")
    with pytest.raises(DataError, match="ok.jsonl:1: image .*red.png cannot be decoded"):
        dataset[0]


def test_an_image_the_processor_cannot_take_is_named(tok, folder):
    Image.new("L", (20, 20), 90).save(folder / "grey.png")
    answer = {"from": "gpt", "value": "Grey\u2028square."}  # a line separator inside a JSON string
    sample = {"image": "grey.png", "conversations": [LLAVA[0]["conversations"][0], answer]}
    _write_jsonl(folder / "grey.jsonl", [sample])
    strict = ImageProcessor.from_dict({**ImageProcessor.siglip(S).to_dict(), "do_convert_rgb": False})
    settings = _settings(tok, processor=strict)
    conversations = read_vision_file(folder / "grey.jsonl", load_chat_template("chatml"), tok, settings)
    dataset = VisionSFTDataset(conversations, settings, 64, tok.pad_id, False, None, 0, "error", "t")
    with pytest.raises(DataError, match="grey.jsonl:1: image .*grey.png cannot be processed: it is in mode L, not RGB"):
        dataset[0]


# ---------------------------------------------------------------- samples


def _colour_of(pixels: torch.Tensor) -> tuple[int, ...]:
    """The RGB colour of a solid processed SigLIP image."""
    return tuple(int(v) for v in torch.round((pixels.mean(dim=(1, 2)) * 0.5 + 0.5) * 255))


@pytest.mark.parametrize("pack", [True, False])
def test_samples_carry_their_images_in_placeholder_order(tok, folder, pack):
    _write_jsonl(folder / "chat.jsonl", LLAVA + [MESSAGES])
    settings = _settings(tok)
    conversations = read_vision_file(folder / "chat.jsonl", load_chat_template("chatml"), tok, settings)
    dataset = VisionSFTDataset(conversations, settings, 96, tok.pad_id, pack, 6, 7, "error", "t")
    seen = []
    for k in range(len(dataset)):
        sample = dataset[k]
        assert sample.images.dtype == torch.float32 and sample.images.shape[1:] == (3, S, S)
        assert np.count_nonzero(sample.input_ids == settings.image_token_id) == TOKENS * len(sample.images)
        assert not (sample.labels == settings.image_token_id).any()
        expected = [COLOURS[Path(r.path).name] for i in dataset.bin_of(k) for r in conversations[int(i)].images]
        assert [_colour_of(p) for p in sample.images] == expected
        again = dataset[k]
        assert all(np.array_equal(a, b) for a, b in zip(sample[:4], again[:4]))
        assert torch.equal(sample.images, again.images)
        seen.append(len(dataset.bin_of(k)))
    assert max(seen) > 1 if pack else set(seen) == {1}
    copy = pickle.loads(pickle.dumps(dataset))  # as data-loader workers receive it
    assert torch.equal(copy[3].images, dataset[3].images)


def test_image_tokens_must_fit_the_sequence(tok, folder):
    _write_jsonl(folder / "chat.jsonl", [LLAVA[1]])
    settings = _settings(tok)
    template = load_chat_template("chatml")
    (conversation,) = read_vision_file(folder / "chat.jsonl", template, tok, settings)
    last = int(np.flatnonzero(conversation.ids == settings.image_token_id)[-1])
    fits = VisionSFTDataset([conversation], settings, last + 1, tok.pad_id, False, None, 0, "truncate", "t")
    sample = fits[0]
    assert len(sample.input_ids) == last + 1 and len(sample.images) == 2 and fits.truncated == 1
    with pytest.raises(DataError, match=f"chat.jsonl:1: its image tokens .* end at token {last + 1}, beyond"):
        VisionSFTDataset([conversation], settings, last, tok.pad_id, False, None, 0, "truncate", "t")
    other = ImageSettings(settings.processor, settings.image_token_id, TOKENS + 1)
    with pytest.raises(ValueError, match="chat.jsonl:1: tokenized with other image settings"):
        VisionSFTDataset([conversation], other, 256, tok.pad_id, False, None, 0, "truncate", "t")


def test_a_text_only_sample_has_no_images(tok, folder):
    _write_jsonl(folder / "chat.jsonl", [LLAVA[2]])
    settings = _settings(tok, processor=ImageProcessor.clip(S))
    conversations = read_vision_file(folder / "chat.jsonl", load_chat_template("chatml"), tok, settings)
    sample = VisionSFTDataset(conversations, settings, 32, tok.pad_id, True, None, 0, "error", "t")[0]
    assert sample.images.shape == (0, 3, S, S)
    assert (sample.labels != IGNORE_INDEX).any()


def test_mock_samples(tok):
    mock = MockVisionSamples(vocab_size=50, seq_length=40, image_token_id=7, tokens_per_image=6, image_size=8, seed=3)
    counts = set()
    for k in range(30):
        sample = mock[k]
        placeholders = sample.input_ids == 7
        counts.add(len(sample.images))
        assert sample.images.shape == (len(sample.images), 3, 8, 8) and sample.images.dtype == torch.float32
        assert np.count_nonzero(placeholders) == 6 * len(sample.images)
        assert all(len(a) == 40 for a in sample[:4]) and sample.input_ids.max() < 50
        assert not (sample.labels == 7).any() and (sample.labels != IGNORE_INDEX).sum() >= 40 - 6 * 2 - 1
        assert torch.equal(mock[k].images, sample.images) and np.array_equal(mock[k].input_ids, sample.input_ids)
    assert counts == {0, 1, 2}
    other = MockVisionSamples(50, 40, 7, 6, 8, seed=4)
    assert any(not np.array_equal(other[k].input_ids, mock[k].input_ids) for k in range(5))
    with pytest.raises(ConfigError, match="--seq-length 6 cannot hold one image's 6 tokens"):
        MockVisionSamples(50, 6, 7, 6, 8, 0)


@pytest.mark.parametrize(
    "name, problem",
    [("missing.png", "image {} does not exist"), ("notes.png", "{} is not an image Pillow can read (PNG, JPEG, ...)")],
)
def test_an_unreadable_image_prompt_names_image_and_its_path(tok, folder, name, problem):
    """A prompt's image came from --image, not a data file: the fix names --image and the path."""
    (folder / "notes.png").write_text("not a picture")
    path = folder / name
    with pytest.raises(DataError) as caught:
        encode_prompt("What is this?", [path], tok, _settings(tok))
    assert str(caught.value) == (
        f"--image {path}: {problem.format(path)}; give --image the path of an existing image file"
    )
