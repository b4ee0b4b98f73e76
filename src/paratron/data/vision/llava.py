"""Image-text conversations: LLaVA's files and the messages form with image parts, tokenized with
each image's placeholder tokens in place.

A file is a JSON list of samples (LLaVA's `.json`) or one sample per line (`.jsonl`), in either form:

    {"image": "a.jpg" | ["a.jpg", "b.jpg"],            (optional; a text-only sample has none)
     "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                       {"from": "gpt", "value": "A cat."}]}        (from: human/user, gpt/assistant, system)

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "A cat."}]}      (content: a string or a list of parts)

Image paths are relative to the image folder (by default the data file's). In LLaVA's form each
image's place is an `<image>` in the text, one per image, in order; in the messages form it is an
image part (a message's parts are joined by newlines, so an image followed by text reads
"<image>\\nWhat is this?", as LLaVA writes it).

A conversation is rendered by the chat template with each image as the tokenizer's image token,
tokenized as for `--sft` (only the assistant's tokens trained), and each image token is then
repeated once per embedding the encoder gives it (tokens_per_image, times its tiles with tiling),
as Hugging Face's LLaVA processor expands it. Placeholders are never trained.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paratron.data.sft.conversations import Message, messages_of, parse_line
from paratron.data.sft.templates import ChatTemplate
from paratron.data.sft.tokenize import TokenizedConversation, tokenize_conversation
from paratron.data.tokenizer import Tokenizer
from paratron.data.vision.images import ImageRef, ImageSettings, image_ref, load_images
from paratron.errors import DataError

PLACEHOLDER = "<image>"
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
FORMS = (
    '{"image": ..., "conversations": [{"from": "human", "value": "<image>\\n..."}, ...]} or '
    '{"messages": [{"role": "user", "content": [{"type": "image", "image": ...}, {"type": "text", ...}]}, ...]}'
)
_WHITESPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class VisionRecord:
    """One sample as read: messages whose text marks each image's place with PLACEHOLDER."""

    messages: list[Message]
    images: list[str]
    """The image paths as written, in the order of their placeholders."""
    where: str


@dataclass(frozen=True, eq=False)
class VisionConversation(TokenizedConversation):
    """A tokenized conversation whose image placeholders are expanded, and the images they stand for."""

    images: tuple[ImageRef, ...] = ()


def read_samples(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line, parsed sample) for each sample of a JSON list or of a file of JSON lines."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; give a .json or .jsonl file of image-text conversations")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}:{line}: byte {exc.start} of the file is not valid UTF-8; save it as UTF-8") from None
    start = _WHITESPACE.match(text).end()  # type: ignore[union-attr]
    if text.startswith("[", start):
        yield from _list_samples(text, start + 1, path)
        return
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if line.strip():
            yield number, parse_line(line, f"{path}:{number}")


def _list_samples(text: str, index: int, path: Path) -> Iterator[tuple[int, Any]]:
    """The elements of a JSON list starting after its '[' at `index`, each with the line it starts on."""
    decoder, line, counted = json.JSONDecoder(), 1, 0
    index = _WHITESPACE.match(text, index).end()  # type: ignore[union-attr]
    if text.startswith("]", index):
        return
    while True:
        line, counted = line + text.count("\n", counted, index), index
        try:
            sample, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}); fix it") from None
        yield line, sample
        index = _WHITESPACE.match(text, index).end()  # type: ignore[union-attr]
        if text.startswith(",", index):
            index = _WHITESPACE.match(text, index + 1).end()  # type: ignore[union-attr]
        elif text.startswith("]", index):
            return
        else:
            where = f"{path}:{line + text.count(chr(10), counted, index)}"
            raise DataError(f"{where}: expected ',' or ']' after a sample of the JSON list; fix the file")


def read_vision_records(path: Path) -> Iterator[VisionRecord]:
    """The samples of `path` in either form, checked: roles, text, and one placeholder per image."""
    for line, sample in read_samples(path):
        yield record_of(sample, f"{path}:{line}")


def record_of(sample: Any, where: str) -> VisionRecord:
    """One parsed sample, in whichever of the two forms it is written."""
    if not isinstance(sample, dict):
        raise DataError(f"{where}: a JSON {type(sample).__name__}, not an object; write each sample as {FORMS}")
    if "conversations" in sample:
        messages, images = _llava_form(sample, where)
    elif "messages" in sample:
        messages, images = _messages_form(sample["messages"], where)
    else:
        raise DataError(f"{where}: no 'conversations' or 'messages' key; write each sample as {FORMS}")
    messages = messages_of({"messages": messages}, where)  # the roles, text and an assistant turn, checked
    placeholders = sum(m["content"].count(PLACEHOLDER) for m in messages)
    if placeholders != len(images):
        raise DataError(
            f"{where}: {placeholders} {PLACEHOLDER} placeholder(s) in the text but {len(images)} image(s); "
            f"put exactly one {PLACEHOLDER} where each image goes"
        )
    return VisionRecord(messages, images, where)


def _llava_form(sample: dict, where: str) -> tuple[list[Any], list[str]]:
    turns = sample["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{'from': ..., 'value': ...}} objects")
    messages = []
    for number, turn in enumerate(turns, start=1):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise DataError(
                f"{where}: turn {number} is not an object with string 'from' and 'value'; "
                'write it as {"from": "human", "value": "..."}'
            )
        if turn["from"] not in SPEAKERS:
            raise DataError(f"{where}: turn {number} is from {turn['from']!r}; the speakers are {', '.join(SPEAKERS)}")
        messages.append({"role": SPEAKERS[turn["from"]], "content": turn["value"]})
    return messages, _image_paths(sample.get("image"), where)


def _image_paths(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else value
    if not (isinstance(paths, list) and all(isinstance(p, str) and p for p in paths)):
        raise DataError(f"{where}: 'image' is {value!r}; write a path or a list of paths")
    return list(paths)


def _messages_form(messages: Any, where: str) -> tuple[list[Any], list[str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    images: list[str] = []
    out = []
    for number, message in enumerate(messages, start=1):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            texts = [_part(part, where, number, images) for part in message["content"]]
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out, images


def _part(part: Any, where: str, number: int, images: list[str]) -> str:
    """The text of one content part; an image part adds its path to `images` and reads as PLACEHOLDER."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "image":
        path = part.get("image", part.get("path"))
        if isinstance(path, str) and path:
            images.append(path)
            return PLACEHOLDER
    raise DataError(
        f"{where}: a content part of message {number} is neither {{'type': 'text', 'text': ...}} "
        f"nor {{'type': 'image', 'image': PATH}}: {json.dumps(part)[:80]}"
    )


def tokenize_vision_record(
    record: VisionRecord, template: ChatTemplate, tokenizer: Tokenizer, settings: ImageSettings, image_folder: Path
) -> VisionConversation:
    """Check the record's images, render and tokenize it, and expand each image's placeholder."""
    refs = tuple(image_ref(_resolve(path, image_folder), settings, record.where) for path in record.images)
    return tokenize_with_images(record, refs, template, tokenizer, settings)


def tokenize_with_images(
    record: VisionRecord,
    refs: tuple[ImageRef, ...],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    settings: ImageSettings,
) -> VisionConversation:
    """Render and tokenize the record, its images already checked (`refs`, in placeholder order),
    and expand each image's placeholder; shared by files and shards."""
    token = image_token(tokenizer, settings.image_token_id)
    messages = [{**m, "content": m["content"].replace(PLACEHOLDER, token)} for m in record.messages]
    plain = tokenize_conversation(messages, template, tokenizer, record.where)
    places = plain.ids == settings.image_token_id
    if np.count_nonzero(places) != len(refs):
        raise DataError(
            f"{record.where}: the tokenized text holds {np.count_nonzero(places)} image token(s) "
            f"(id {settings.image_token_id}, {token!r}) for {len(refs)} image(s); the text must not contain "
            f"{token!r} itself, and the tokenizer must keep it one token (add it as a special token)"
        )
    repeats = np.ones(len(plain.ids), dtype=np.int64)
    repeats[places] = [ref.tiles * settings.tokens_per_image for ref in refs]
    ids = np.repeat(plain.ids, repeats)
    trained = np.repeat(plain.trained, repeats) & (ids != settings.image_token_id)
    return VisionConversation(ids, trained, record.where, refs)


def with_placeholders(text: str, images: int) -> str:
    """`text` as a prompt for `images` images: as it is when it places `<image>` itself, else one before it each."""
    return text if PLACEHOLDER in text or not images else f"{PLACEHOLDER}\n" * images + text


def encode_prompt(
    text: str, paths: list[Path], tokenizer: Tokenizer, settings: ImageSettings
) -> tuple[list[int], torch.Tensor]:
    """A generation prompt with images: its token ids, each `<image>` of `text` (or, when it names none, one per
    image before the text) expanded to that image's placeholder tokens, and the images' pixels."""
    text = with_placeholders(text, len(paths))
    if text.count(PLACEHOLDER) != len(paths):
        raise DataError(
            f"the prompt names {text.count(PLACEHOLDER)} {PLACEHOLDER} for {len(paths)} --image; give one each"
        )
    fix = "give --image the path of an existing image file"
    refs = [image_ref(path, settings, f"--image {path}", fix=fix) for path in paths]
    ids = np.asarray(tokenizer.encode(text.replace(PLACEHOLDER, image_token(tokenizer, settings.image_token_id))))
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[ids == settings.image_token_id] = [ref.tiles * settings.tokens_per_image for ref in refs]
    return np.repeat(ids, repeats).tolist(), load_images(refs, settings, "--image", fix)


def image_token(tokenizer: Tokenizer, image_token_id: int) -> str:
    """The text of the image token, which stands for each image when a conversation is rendered."""
    token = tokenizer.token(image_token_id) if 0 <= image_token_id < tokenizer.vocab_size else None
    if token is None:
        raise DataError(
            f"the image token id {image_token_id} is not in the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} ids); add an image token such as {PLACEHOLDER!r} to the tokenizer"
        )
    return token


def _resolve(path: str, image_folder: Path) -> Path:
    written = Path(path).expanduser()
    return written if written.is_absolute() else image_folder / written


def iter_vision_file(
    path: Path, template: ChatTemplate, tokenizer: Tokenizer, settings: ImageSettings, image_folder: Path | None = None
) -> Iterator[VisionConversation]:
    """The conversations of one file, tokenized one at a time; images under `image_folder`
    (default: the file's folder)."""
    folder = Path(image_folder).expanduser() if image_folder is not None else Path(path).parent
    if not folder.is_dir():
        raise DataError(f"--image-folder {folder}: no such folder; give the folder the image paths are relative to")
    for record in read_vision_records(path):
        yield tokenize_vision_record(record, template, tokenizer, settings, folder)


def read_vision_file(
    path: Path, template: ChatTemplate, tokenizer: Tokenizer, settings: ImageSettings, image_folder: Path | None = None
) -> list[VisionConversation]:
    """Every conversation of `path`, checked and tokenized before training starts."""
    return list(iter_vision_file(path, template, tokenizer, settings, image_folder))
