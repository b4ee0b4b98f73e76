"""Webdataset shards and Megatron-Energon folders as image-text data: their samples equal those of the
same conversations written as a .jsonl file with image files (ids, trained mask, pixels), the caption
and question forms, the field maps and splits of `.nv-meta/`, and bad input named by shard and key."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import AddedToken

from paratron.config import build_config
from paratron.data.sft import load_chat_template
from paratron.data.sft.sources import VisionData, load_task, whole_tasks
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe
from paratron.data.vision import ImageProcessor, ImageSettings, VisionSFTDataset, load_images, read_vision_file
from paratron.data.vision.shards import CAPTION_INSTRUCTION, expand_braces
from paratron.errors import DataError

SPECIALS = ["<|im_start|>", "<|im_end|>", "<image>"]
TEXTS = ["What is in the picture? A red square. Describe both. Two squares, red and blue."] * 30
S, TOKENS = 16, 3
RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 160, 0)
ASK = {"from": "human", "value": "<image>\nWhat is in the picture?"}
LLAVA = [  # (key, image colours, the sample as LLaVA's .json writes it without its "image")
    ("000000", [RED], {"conversations": [ASK, {"from": "gpt", "value": "A red square."}]}),
    (
        "000001",
        [RED, BLUE],
        {
            "conversations": [
                {"from": "system", "value": "Describe both."},
                {"from": "human", "value": "<image> and <image>?"},
                {"from": "gpt", "value": "Two squares, red and blue."},
            ]
        },
    ),
    ("000002", [GREEN], {"conversations": [ASK, {"from": "gpt", "value": "A green one."}]}),
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    bpe = train_byte_level_bpe(iter(TEXTS), vocab_size=300)
    bpe.hf.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return Tokenizer(bpe.hf, "test")


@pytest.fixture()
def images(tok: Tokenizer) -> VisionData:
    return VisionData(ImageSettings(ImageProcessor.siglip(S), tok.hf.token_to_id("<image>"), TOKENS), None)


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (24, 20)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def _write_tar(path: Path, files: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _llava_files(key: str, colours: list, sample: dict) -> list[tuple[str, bytes]]:
    """A sample's files as a webdataset writer lays them out: images named in order, then the json."""
    suffixes = ["png"] if len(colours) == 1 else [f"{n}.png" for n in range(len(colours))]
    files = [(f"{key}.{s}", _png(c)) for s, c in zip(suffixes, colours)]
    return files + [(f"{key}.json", json.dumps(sample).encode())]


def _same_as_jsonl(tmp_path: Path, samples: list[tuple[list, dict]], got: list, tok, images: VisionData) -> None:
    """`got` equals the conversations of `samples` written as a .jsonl file with image files: tokens, trained
    mask and pixels."""
    lines = []
    for n, (colours, sample) in enumerate(samples):
        names = [f"img{n}_{i}.png" for i in range(len(colours))]
        for name, colour in zip(names, colours):
            (tmp_path / name).write_bytes(_png(colour))
        lines.append(json.dumps({**sample, "image": names}))
    (tmp_path / "same.jsonl").write_text("\n".join(lines) + "\n")
    expected = read_vision_file(tmp_path / "same.jsonl", load_chat_template("chatml"), tok, images.settings)
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        assert mine.ids.tolist() == theirs.ids.tolist()
        assert mine.trained.tolist() == theirs.trained.tolist()
        assert [r.tiles for r in mine.images] == [r.tiles for r in theirs.images]
        mine_pixels = load_images(list(mine.images), images.settings, mine.where)
        assert torch.equal(mine_pixels, load_images(list(theirs.images), images.settings, theirs.where))


def _load(path: Path | str, tok: Tokenizer, images: VisionData) -> list:
    return list(load_task(str(path), load_chat_template("chatml"), tok, images))


def test_expand_braces():
    assert expand_braces("s_{008..011}.tar") == ["s_008.tar", "s_009.tar", "s_010.tar", "s_011.tar"]
    assert expand_braces("{a,b}/x_{1..2}.tar") == ["a/x_1.tar", "a/x_2.tar", "b/x_1.tar", "b/x_2.tar"]
    with pytest.raises(DataError, match=r"runs backwards; write \{1..3\}"):
        expand_braces("s_{3..1}.tar")


def test_shards_equal_the_same_conversations_as_a_jsonl_file(tmp_path, tok, images):
    files = [_llava_files(*sample) for sample in LLAVA]
    _write_tar(tmp_path / "wds" / "shard_000.tar", files[0] + files[1])
    _write_tar(tmp_path / "wds" / "shard_001.tar", files[2])
    expected = [(colours, sample) for _, colours, sample in LLAVA]
    for entry in ("wds", "wds/shard_{000..001}.tar"):
        got = _load(tmp_path / entry, tok, images)
        _same_as_jsonl(tmp_path, expected, got, tok, images)
    assert [c.where for c in got] == [
        f"{tmp_path}/wds/shard_00{s}.tar: sample 00000{k}" for s, k in ((0, 0), (0, 1), (1, 2))
    ]
    assert got[1].images[1].path == f"{tmp_path}/wds/shard_000.tar#000001.1.png"
    one = _load(tmp_path / "wds" / "shard_001.tar", tok, images)
    _same_as_jsonl(tmp_path, expected[2:], one, tok, images)
    dataset = VisionSFTDataset(got, images.settings, 96, tok.pad_id, True, 4, 3, "error", "t")
    copy = pickle.loads(pickle.dumps(dataset))  # as data-loader workers receive it
    for k in range(len(dataset)):
        assert torch.equal(copy[k].images, dataset[k].images) and len(dataset[k].images) > 0


def test_caption_vqa_messages_and_bare_turns(tmp_path, tok, images):
    turns = LLAVA[0][2]["conversations"]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": "x.jpg"}, {"type": "text", "text": "What is?"}]},
        {"role": "assistant", "content": "A blue square."},
    ]
    samples = [
        ("a", {"caption": " A red square. "}),
        (
            "b",
            {
                "question": "What is in the picture?",
                "answers": ["red", "crimson", "scarlet"],
                "answer_weights": [1, 3, 3],
            },
        ),
        ("c", {"context": "<image>\nWhich colour?", "answer": "Green."}),
        ("d", turns),
        ("e", {"messages": messages}),
    ]
    files = [(f"{k}.png", _png(RED)) for k, _ in samples]
    tar = [
        (name, data)
        for (k, s), (name, data) in zip(samples, files)
        for name, data in [(name, data), (f"{k}.json", json.dumps(s).encode())]
    ]
    tar += [("f.jpg", _png(BLUE)), ("f.txt", b"A blue square.")]  # a caption as text (PNG bytes as .jpg)
    big = b'{"caption": "A big one."}' + b" " * (1 << 20)  # past what is read with the index: read when needed
    tar += [("g.webp", _png(GREEN)), ("g.json", big)]
    got = _load(_write_tar(tmp_path / "forms.tar", tar), tok, images)

    def chat(question: str, answer: str) -> dict:
        return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}

    caption = f"<image>\n{CAPTION_INSTRUCTION}"
    expected = [
        ([RED], chat(caption, "A red square.")),
        ([RED], chat("<image>\nWhat is in the picture?", "crimson")),  # the first of the highest weight
        ([RED], chat("<image>\nWhich colour?", "Green.")),
        ([RED], {"conversations": turns}),
        ([RED], chat("<image>\nWhat is?", "A blue square.")),
        ([BLUE], chat(caption, "A blue square.")),
        ([GREEN], chat(caption, "A big one.")),
    ]
    _same_as_jsonl(tmp_path, expected, got, tok, images)


def _energon(folder: Path, dataset: str, splits: str, counts: dict | None = None) -> Path:
    """The `.nv-meta/` files as `energon prepare` writes them."""
    meta = folder / ".nv-meta"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "dataset.yaml").write_text(dataset)
    (meta / "split.yaml").write_text(splits)
    if counts is not None:
        (meta / ".info.json").write_text(json.dumps({"energon_version": "7.1.0", "shard_counts": counts}))
    return folder


LLAVA_PRETRAIN = """sample_type:
  __module__: megatron.energon
  __class__: VQASample
field_map:
  image: jpg
  context: json[0][value]
  answers: json[1][value]
"""
SPLITS = """exclude:
- shards/pretrain-1.tar/000003
split_parts:
  train:
  - shards/pretrain-{0..1}.tar
  val:
  - shards/pretrain-2.tar
  test: []
"""


def test_energon_vqa_folder_as_megatron_llava_pretraining_writes_it(tmp_path, tok, images):
    """Megatron-LM's LLaVA-pretraining shards: KEY.jpg and KEY.json holding the turns, read as VQASample."""
    colours = [RED, BLUE, GREEN, RED, BLUE]
    answers = [f"Square number {n}." for n in range(5)]
    for shard, keys in enumerate([[0, 1], [2, 3], [4]]):
        files = []
        for k in keys:
            turns = [ASK, {"from": "gpt", "value": answers[k]}]
            files += [(f"00000{k}.jpg", _png(colours[k])), (f"00000{k}.json", json.dumps(turns).encode())]
        _write_tar(tmp_path / "ds" / "shards" / f"pretrain-{shard}.tar", files)
    counts = {f"shards/pretrain-{n}.tar": c for n, c in enumerate([2, 2, 1])}
    folder = _energon(tmp_path / "ds", LLAVA_PRETRAIN, SPLITS, counts)
    expected = [([colours[k]], {"conversations": [ASK, {"from": "gpt", "value": answers[k]}]}) for k in range(5)]
    _same_as_jsonl(tmp_path, expected[:3], _load(folder, tok, images), tok, images)  # sample 3 excluded
    _same_as_jsonl(tmp_path, expected[4:], _load(f"{folder}:val", tok, images), tok, images)
    with pytest.raises(DataError, match=r"ds:test: the split 'test' holds no shards|split 'test' holds no shards"):
        _load(f"{folder}:test", tok, images)
    with pytest.raises(DataError, match=r"no split 'dev' in .*split.yaml; the splits are train, val, test"):
        _load(f"{folder}:dev", tok, images)
    _energon(folder, LLAVA_PRETRAIN, SPLITS, {**counts, "shards/pretrain-2.tar": 7})
    with pytest.raises(
        DataError, match=r"pretrain-2.tar: holds 1 samples but .*\.info\.json counted 7; .*energon prepare"
    ):
        _load(f"{folder}:val", tok, images)


@pytest.mark.parametrize(
    "dataset",
    [
        "sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
        "field_map:\n  image: jpg,png\n  caption: txt\n",
        "__module__: megatron.energon\n__class__: CaptioningWebdataset\n"
        "field_map:\n  image: png\n  caption: json[caption]\n",
        "__module__: megatron.energon\n__class__: CrudeWebdataset\n",
    ],
)
def test_energon_captions(tmp_path, tok, images, dataset):
    files = [("k1.png", _png(GREEN)), ("k1.txt", b"A green square."), ("k1.json", b'{"caption": "A green square."}')]
    folder = _energon(tmp_path / "cap", dataset, "split_parts:\n  train:\n  - a.tar\n")
    _write_tar(folder / "a.tar", files)
    expected = [
        (
            [GREEN],
            {
                "conversations": [
                    {"from": "human", "value": f"<image>\n{CAPTION_INSTRUCTION}"},
                    {"from": "gpt", "value": "A green square."},
                ]
            },
        )
    ]
    _same_as_jsonl(tmp_path, expected, _load(folder, tok, images), tok, images)


def test_energon_interleaved_sft_with_image_tags(tmp_path, tok, images):
    """Megatron-LM's SFT samples (SimilarityInterleavedSample): `<image-N>` names the image at each place."""
    dataset = (
        "sample_type:\n  __module__: megatron.energon\n  __class__: SimilarityInterleavedSample\n"
        "field_map:\n  texts: json\n"
    )
    turns = [{"from": "human", "value": "<image-2> then <image-1>?"}, {"from": "gpt", "value": "Blue, then red."}]
    files = [("s.0.png", _png(RED)), ("s.1.png", _png(BLUE)), ("s.json", json.dumps(turns).encode())]
    folder = _energon(tmp_path / "sft", dataset, "split_parts:\n  train: [s.tar]\n", {"s.tar": 1})
    _write_tar(folder / "s.tar", files)
    plain = [{"from": "human", "value": "<image> then <image>?"}, turns[1]]
    _same_as_jsonl(tmp_path, [([BLUE, RED], {"conversations": plain})], _load(folder, tok, images), tok, images)


BAD_SAMPLES = [
    ([("k.json", json.dumps(LLAVA[0][2]).encode())], r"a.tar: sample k: no image file"),
    ([("k.png", _png(RED))], r"a.tar: sample k: no .json or .txt file"),
    ([("k.png", b"not a picture"), ("k.txt", b"A cap.")], r"a.tar: sample k: .*a.tar#k.png is not an image Pillow"),
    (
        [("k.png", _png(RED)), ("k.json", json.dumps(LLAVA[1][2]).encode())],
        r"a.tar: sample k: 2 <image> placeholder\(s\) in the text but 1 image",
    ),
    ([("k.png", _png(RED)), ("k.json", b'{"caption": ')], r"a.tar: sample k: k.json is not valid JSON"),
    ([("k.png", _png(RED)), ("k.json", b'{"text": "x"}')], r"a.tar: sample k: k.json holds none of 'conversations'"),
    ([("k.png", _png(RED)), ("k.json", b'{"question": "Q?", "answers": []}')], r"a.tar: sample k: the answer is \[\]"),
    (
        [("j.png", _png(RED)), ("j.txt", b"x"), ("k.png", _png(RED)), ("k.txt", b"y"), ("j.cls", b"1")],
        r"a.tar: the files of sample j are not together",
    ),
    ([("README", b"x")], r"a.tar: member 'README' is not named KEY.EXTENSION"),
]


def test_a_broken_image_fails_when_drawn_naming_shard_and_member(tmp_path, tok, images):
    data = _png(RED, (64, 64))
    shard = _write_tar(tmp_path / "a.tar", [("k.png", data[: len(data) // 2]), ("k.txt", b"A cap.")])
    conversations = _load(shard, tok, images)  # the header is whole
    dataset = VisionSFTDataset(conversations, images.settings, 64, tok.pad_id, False, None, 0, "error", "t")
    with pytest.raises(DataError, match=r"a.tar: sample k: image .*a.tar#k.png cannot be decoded"):
        dataset[0]


@pytest.mark.parametrize("files,message", BAD_SAMPLES)
def test_bad_samples_name_shard_and_key(tmp_path, tok, images, files, message):
    with pytest.raises(DataError, match=message):
        _load(_write_tar(tmp_path / "a.tar", files), tok, images)


CAPTIONING = "sample_type: {__module__: megatron.energon, __class__: CaptioningSample}\n"


def test_bad_shards_and_energon_folders(tmp_path, tok, images):
    with tarfile.open(tmp_path / "z.tar", "w:gz") as archive:
        archive.addfile(tarfile.TarInfo("k.txt"), io.BytesIO(b""))
    with pytest.raises(DataError, match="z.tar: not an uncompressed tar file"):
        _load(tmp_path / "z.tar", tok, images)
    whole = _write_tar(tmp_path / "w.tar", [("k.png", _png(RED)), ("k.txt", b"A cap."), ("l.txt", b"x" * 600)])
    (tmp_path / "cut.tar").write_bytes(whole.read_bytes()[:2000])  # ends inside the last member's header or data
    with pytest.raises(DataError, match="cut.tar: a damaged tar file"):
        _load(tmp_path / "cut.tar", tok, images)
    _write_tar(tmp_path / "shard_001.tar", [("k.png", _png(RED)), ("k.txt", b"A cap.")])
    with pytest.raises(DataError, match=r"shard_002.tar: no such shard \(from --data-path"):
        _load(tmp_path / "shard_{001..002}.tar", tok, images)
    splits = "split_parts:\n  train: [a.tar]\n"
    _write_tar(tmp_path / "e" / "a.tar", [("k.png", _png(RED)), ("k.txt", b"A cap.")])
    refusals = {
        "sample_type:\n  __module__: megatron.energon\n  __class__: OCRSample\nfield_map: {image: png}\n": (
            "sample type megatron.energon.OCRSample is not supported; use one of CaptioningSample, VQASample"
        ),
        "sample_type:\n  __module__: mine\n  __class__: VQASample\n": "sample type mine.VQASample is not supported",
        "sample_type: {__module__: megatron.energon, __class__: VQASample}\nsample_loader: sample_loader.py:f\n"
        "part_filter: sample_loader.py:g\n": "a sample_loader is code paratron does not run",
        "sample_type: {__module__: megatron.energon, __class__: VQASample}\nfield_map: {image: png, context: txt}\n": (
            "the field_map of VQASample lacks answers"
        ),
        f"{CAPTIONING}field_map: {{image: txt, caption: txt}}\n": (
            "a.tar: sample k: the field image is not an image file"
        ),
        f"{CAPTIONING}field_map: {{image: png, caption: json}}\n": (
            r"a.tar: sample k: nothing at 'json' for the field caption \(.*dataset.yaml\)"
        ),
        "sample_type: [\n": r"dataset.yaml:2: not valid YAML \(expected the node content",
    }
    for dataset, message in refusals.items():
        _energon(tmp_path / "e", dataset, splits)
        with pytest.raises(DataError, match=message):
            _load(tmp_path / "e", tok, images)
    _energon(tmp_path / "e", f"{CAPTIONING}field_map: {{image: png, caption: txt}}\n", splits)
    assert len(_load(tmp_path / "e", tok, images)) == 1
    (tmp_path / "e" / ".nv-meta" / "split.yaml").unlink()
    with pytest.raises(DataError, match=r"split.yaml: missing; .*energon prepare"):
        _load(tmp_path / "e", tok, images)


@pytest.mark.parametrize("pack", [True, False])
def test_a_runs_tasks_from_shards_equal_those_from_a_jsonl_file(tmp_path, tok, pack):
    """Through the run's own settings (image processor, tokens per image of the configured encoder): the samples
    of a shard folder and of an Energon folder equal the .jsonl file's, pixels included."""
    model = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=tok.vocab_size)
    settings = dict(vision_model="debug-vit", sft=True, seq_length=160, chat_template="chatml", sft_pack=pack)
    config = build_config({**model, **settings}, recipe="debug")
    files = [_llava_files(*sample) for sample in LLAVA]
    _write_tar(tmp_path / "wds" / "shard_000.tar", files[0] + files[1] + files[2])
    interleaved = "sample_type: {__module__: megatron.energon, __class__: SimilarityInterleavedSample}\n"
    splits = "split_parts: {train: [shard_000.tar]}\n"
    _energon(
        tmp_path / "wds", interleaved + "field_map: {texts: 'json[conversations]'}\n", splits, {"shard_000.tar": 3}
    )
    (tmp_path / "plain").mkdir()
    _write_tar(tmp_path / "plain" / "shard_000.tar", files[0] + files[1] + files[2])
    lines = []
    for n, (_, colours, sample) in enumerate(LLAVA):
        names = [f"img{n}_{i}.png" for i in range(len(colours))]
        for name, colour in zip(names, colours):
            (tmp_path / name).write_bytes(_png(colour))
        lines.append(json.dumps({**sample, "image": names}) + "\n")
    (tmp_path / "chat.jsonl").write_text("".join(lines))
    paths = [str(tmp_path / "chat.jsonl"), str(tmp_path / "plain"), str(tmp_path / "wds")]
    reference, *others = whole_tasks(config, tok, paths, ["jsonl", "plain", "energon"])
    assert len(reference) > 0 and reference.settings.tokens_per_image == config.model.image_tokens
    for dataset in others:
        assert len(dataset) == len(reference)
        for k in range(len(reference)):
            mine, theirs = dataset[k], reference[k]
            assert all(np.array_equal(a, b) for a, b in zip(mine[:4], theirs[:4]))
            assert mine.images.shape[0] > 0 and torch.equal(mine.images, theirs.images)
