"""Image-text samples from webdataset shards: tar files in which the files sharing a key (the name
up to the first dot of its last component) make one sample, such as `000042.jpg` + `000042.json`.

A sample's images are its image files (jpg, png, webp, ...), in the order of their names; its text
is its `.json` file, in one of the forms

    {"conversations": [...]} or a bare list of turns     LLaVA's form, one `<image>` per image
    {"messages": [...]}                                   the messages form, one image part per image
    {"caption": "..."}  (or a `.txt` file instead)        a caption: the user shows the image(s) with
                                                          CAPTION_INSTRUCTION, the caption is the answer
    {"question" | "context": ..., "answer" | "answers": ...}   a question about the image(s)

Only each image's place in the shard (offset, size) is kept; its bytes are read when the sample is
drawn. Shards must be plain (uncompressed) tar files so that an image can be read at its offset.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratron.data.sft.templates import ChatTemplate
from paratron.data.tokenizer import Tokenizer
from paratron.data.vision.images import ImageSettings, image_ref
from paratron.data.vision.llava import PLACEHOLDER, VisionConversation, VisionRecord, record_of, tokenize_with_images
from paratron.errors import DataError

CAPTION_INSTRUCTION = "Describe the image briefly."
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm"})
TEXT_READ_AT_ONCE = 1 << 20
"""Parts other than images up to this size are read with the index; larger ones (video, audio) only if asked for."""
_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


@dataclass(frozen=True)
class ShardPart:
    """One file of a sample: its name in the shard and where its bytes are (small parts other than images are
    read at once, into `text`)."""

    name: str
    offset: int
    size: int
    text: bytes | None = None


@dataclass
class ShardSample:
    """The files of one key of a shard, by extension (what follows the key's dot: `jpg`, `detail.json`)."""

    shard: Path
    key: str
    parts: dict[str, ShardPart] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.shard}: sample {self.key}"

    def images(self) -> list[ShardPart]:
        """The sample's image files in the order of their names."""
        return [self.parts[ext] for ext in sorted(self.parts) if is_image_part(ext)]


SampleReader = Callable[[ShardSample], tuple[VisionRecord, list[ShardPart]]]


def expand_braces(pattern: str) -> list[str]:
    """Webdataset's shard patterns: `a_{000..003}.tar` (zero-padded as written) and `{a,b}.tar`, left to right."""
    match = _BRACES.search(pattern)
    if match is None:
        return [pattern]
    inner, head, tail = match.group(1), pattern[: match.start()], pattern[match.end() :]
    numbers = _RANGE.match(inner)
    if numbers:
        first, last = numbers.groups()
        if int(last) < int(first):
            raise DataError(f"{pattern}: the range {{{inner}}} runs backwards; write {{{last}..{first}}}")
        width = len(first) if first.startswith("0") else 0
        choices = [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    else:
        choices = inner.split(",")
    return [name for choice in choices for name in expand_braces(head + choice + tail)]


def is_shard_source(path: str) -> bool:
    """Whether a --data-path entry names webdataset shards: a .tar file, a brace pattern, or a folder of .tar files."""
    if path.endswith(".tar") or _BRACES.search(path):
        return True
    folder = Path(path)
    return folder.is_dir() and any(folder.glob("*.tar"))


def shard_paths(path: str) -> list[Path]:
    """The shards a --data-path entry names, in order; each must exist."""
    folder = Path(path)
    if folder.is_dir():
        shards = sorted(folder.glob("*.tar"))
        if not shards:
            raise DataError(f"{path}: a folder without .tar shards; give shards or a folder holding them")
        return shards
    shards = [Path(name) for name in expand_braces(path)]
    for shard in shards:
        if not shard.is_file():
            raise DataError(f"{shard}: no such shard (from --data-path {path}); check the path or the pattern")
    return shards


def iter_shard_samples(shard: Path) -> Iterator[ShardSample]:
    """The samples of one shard in order: consecutive files sharing a key."""
    try:
        archive = tarfile.open(shard, "r:")
    except tarfile.ReadError:
        raise DataError(
            f"{shard}: not an uncompressed tar file; write webdataset shards as plain .tar (images are read "
            "at their offset in the shard)"
        ) from None
    except OSError as exc:
        raise DataError(f"{shard}: cannot be read ({exc.strerror or exc}); check the file") from None
    seen: set[str] = set()
    sample: ShardSample | None = None
    with archive:
        for member in _members(archive, shard):
            if not member.isfile():
                continue
            key, ext = _split_name(member.name, shard)
            if sample is None or key != sample.key:
                if sample is not None:
                    yield sample
                if key in seen:
                    raise DataError(
                        f"{shard}: the files of sample {key} are not together; write each sample's files in a row"
                    )
                seen.add(key)
                sample = ShardSample(shard, key)
            text = None
            if not is_image_part(ext) and member.size <= TEXT_READ_AT_ONCE:
                text = archive.extractfile(member).read()  # type: ignore[union-attr]
            sample.parts[ext] = ShardPart(member.name, member.offset_data, member.size, text)
    if sample is not None:
        yield sample


def _members(archive: tarfile.TarFile, shard: Path) -> Iterator[tarfile.TarInfo]:
    while True:
        try:
            member = archive.next()
        except (tarfile.TarError, OSError) as exc:
            raise DataError(f"{shard}: a damaged tar file ({exc}); write the shard again") from None
        if member is None:
            return
        yield member


def is_image_part(ext: str) -> bool:
    """Whether a part's extension (`jpg`, `img1.png`) names an image."""
    return ext.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS


def _split_name(name: str, shard: Path) -> tuple[str, str]:
    folder, _, base = name.rpartition("/")
    dot = base.find(".")
    if dot <= 0 or dot == len(base) - 1:
        raise DataError(f"{shard}: member {name!r} is not named KEY.EXTENSION; every file of a shard must be")
    return (f"{folder}/" if folder else "") + base[:dot], base[dot + 1 :]


def decode_text(sample: ShardSample, ext: str) -> Any:
    """The part `ext` decoded: JSON for a json extension, else UTF-8 text."""
    part = sample.parts[ext]
    data = part.text
    if data is None:
        with open(sample.shard, "rb") as file:
            file.seek(part.offset)
            data = file.read(part.size)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{sample.where}: {part.name} is not valid UTF-8; save it as UTF-8") from None
    if not ext.lower().endswith("json"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{sample.where}: {part.name} is not valid JSON ({exc.msg}, column {exc.colno})") from None


def _text_part(sample: ShardSample, kind: str) -> str | None:
    """The extension of the sample's `kind` (json or txt) part: exactly `kind`, else the only `*.kind`."""
    if kind in sample.parts:
        return kind
    found = [ext for ext in sample.parts if ext.lower().endswith("." + kind) or ext.lower() == kind]
    return found[0] if len(found) == 1 else None


def plain_record(sample: ShardSample) -> tuple[VisionRecord, list[ShardPart]]:
    """The conversation of a plain webdataset sample, from its json (or txt caption) and images."""
    images = sample.images()
    if not images:
        raise DataError(
            f"{sample.where}: no image file ({', '.join(sorted(IMAGE_EXTENSIONS))}); add the sample's image"
        )
    ext = _text_part(sample, "json") or _text_part(sample, "txt")
    if ext is None:
        raise DataError(f"{sample.where}: no .json or .txt file; add the sample's conversation, caption or question")
    value = decode_text(sample, ext)
    if isinstance(value, str):
        return caption_record(value, images, sample), images
    if isinstance(value, list) or (isinstance(value, dict) and ("conversations" in value or "messages" in value)):
        return conversation_record(value, images, sample), images
    if isinstance(value, dict) and "caption" in value:
        return caption_record(value["caption"], images, sample), images
    if isinstance(value, dict) and ("question" in value or "context" in value):
        question = value.get("question", value.get("context"))
        answers = value.get("answers", value.get("answer"))
        return vqa_record(question, answers, value.get("answer_weights"), images, sample), images
    raise DataError(
        f"{sample.where}: {sample.parts[ext].name} holds none of 'conversations', 'messages', 'caption', "
        "'question'/'context' with 'answer(s)'; write the sample in one of these forms"
    )


def _names(images: Sequence[ShardPart], sample: ShardSample) -> list[str]:
    return [f"{sample.shard}#{part.name}" for part in images]


def conversation_record(value: Any, images: Sequence[ShardPart], sample: ShardSample) -> VisionRecord:
    """LLaVA's form (an object with 'conversations', or the bare list of turns) or the messages form."""
    if isinstance(value, list):
        value = {"conversations": value}
    if "conversations" in value:
        return record_of({**value, "image": _names(images, sample)}, sample.where)
    record = record_of(value, sample.where)
    if len(record.images) != len(images):
        raise DataError(
            f"{sample.where}: {len(record.images)} image part(s) in the messages but {len(images)} image file(s) "
            "in the sample; give one image part per image file"
        )
    return VisionRecord(record.messages, _names(images, sample), sample.where)


def caption_record(caption: Any, images: Sequence[ShardPart], sample: ShardSample) -> VisionRecord:
    """The image(s) shown with CAPTION_INSTRUCTION; the caption is the answer."""
    if not isinstance(caption, str) or not caption.strip():
        raise DataError(f"{sample.where}: the caption is {caption!r}; give a non-empty caption")
    prompt = f"{PLACEHOLDER}\n" * len(images) + CAPTION_INSTRUCTION
    turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": caption.strip()}]
    return record_of({"conversations": turns, "image": _names(images, sample)}, sample.where)


def vqa_record(
    question: Any, answers: Any, weights: Any, images: Sequence[ShardPart], sample: ShardSample
) -> VisionRecord:
    """A question about the image(s) (each `<image>` where written, else all before the question) and its answer:
    of several answers, the first of the highest weight."""
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{sample.where}: the question is {question!r}; give a non-empty question")
    answer = _one_answer(answers, weights, sample)
    if PLACEHOLDER not in question:
        question = f"{PLACEHOLDER}\n" * len(images) + question
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return record_of({"conversations": turns, "image": _names(images, sample)}, sample.where)


def _one_answer(answers: Any, weights: Any, sample: ShardSample) -> str:
    if isinstance(answers, str) and answers.strip():
        return answers
    if isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers):
        if weights is None:
            return answers[0]
        if isinstance(weights, list) and len(weights) == len(answers):
            return answers[max(range(len(answers)), key=lambda i: (float(weights[i]), -i))]
        raise DataError(f"{sample.where}: answer_weights {weights!r} do not match the {len(answers)} answers")
    raise DataError(f"{sample.where}: the answer is {answers!r}; give a non-empty answer or a list of them")


def tokenize_shard_samples(
    samples: Iterable[ShardSample],
    read: SampleReader,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    settings: ImageSettings,
) -> list[VisionConversation]:
    """Every sample read, its images' headers checked, tokenized, before training starts."""
    conversations = []
    for sample in samples:
        record, images = read(sample)
        refs = tuple(
            image_ref(Path(name), settings, record.where, (part.offset, part.size), str(sample.shard))
            for name, part in zip(record.images, images)
        )
        conversations.append(tokenize_with_images(record, refs, template, tokenizer, settings))
    return conversations


def read_shards(
    path: str, template: ChatTemplate, tokenizer: Tokenizer, settings: ImageSettings
) -> list[VisionConversation]:
    """The conversations of the webdataset shards a --data-path entry names."""
    samples = (sample for shard in shard_paths(path) for sample in iter_shard_samples(shard))
    return tokenize_shard_samples(samples, plain_record, template, tokenizer, settings)
