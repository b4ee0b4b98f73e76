"""Megatron-Energon datasets: a folder of webdataset shards with the `.nv-meta/` files `energon prepare`
writes, read without Energon itself.

- `dataset.yaml`: the sample type and how a sample's files fill it (`field_map`, such as
  `image: jpg`, `context: json[0][value]`; `a,b` tries `a`, then `b`). The sample types read are
  SAMPLE_TYPES; a crude dataset (`CrudeWebdataset`) is read as plain shards (`data.vision.shards`).
- `split.yaml`: the shards of each split (`split_parts`) and the shards or samples to leave out (`exclude`).
- `.info.json` (`.info.yaml` before Energon 7): the samples of each shard, checked against the shards.

A --data-path entry `FOLDER` reads the split `train`; `FOLDER:val` (or any split's name) another.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from paratron.data.sft.templates import ChatTemplate
from paratron.data.tokenizer import Tokenizer
from paratron.data.vision.images import ImageSettings
from paratron.data.vision.llava import PLACEHOLDER, VisionConversation, VisionRecord
from paratron.data.vision.shards import (
    SampleReader,
    ShardPart,
    ShardSample,
    caption_record,
    conversation_record,
    decode_text,
    expand_braces,
    is_image_part,
    iter_shard_samples,
    plain_record,
    tokenize_shard_samples,
    vqa_record,
)
from paratron.errors import DataError

META = ".nv-meta"
DEFAULT_SPLIT = "train"
SAMPLE_TYPES = {  # the fields each reads; those in brackets may be left out of the field_map
    "CaptioningSample": ("image", "caption"),
    "VQASample": ("image", "context", "answers", "[answer_weights]"),
    "SimilarityInterleavedSample": ("[images]", "texts"),
}
_LEGACY_CLASSES = {name.replace("Sample", "Webdataset"): name for name in SAMPLE_TYPES}
_CRUDE = "CrudeWebdataset"
_FIELD = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]+\])*)$")
_IMAGE_TAG = re.compile(r"<image-(\d+)>")


@dataclass(frozen=True)
class EnergonDataset:
    """What `.nv-meta/dataset.yaml` says: the sample type (None: crude, read as plain shards) and its field map."""

    sample_type: str | None
    field_map: dict[str, str]
    source: Path


def energon_folder(path: str) -> tuple[Path, str] | None:
    """(folder, split) when a --data-path entry names an Energon dataset (`FOLDER` or `FOLDER:SPLIT`), else None."""
    candidates = [(path, DEFAULT_SPLIT)]
    if ":" in path:
        folder, split = path.rsplit(":", 1)
        candidates.append((folder, split))
    for folder, split in candidates:
        if (Path(folder) / META / "dataset.yaml").is_file():
            return Path(folder), split
    return None


def _load_yaml(path: Path) -> Any:
    if not path.is_file():
        raise DataError(f"{path}: missing; an Energon dataset needs it (run `energon prepare` on the folder)")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{path}: not valid UTF-8; save it as UTF-8") from None
    except yaml.MarkedYAMLError as exc:
        line = f":{exc.problem_mark.line + 1}" if exc.problem_mark else ""
        raise DataError(f"{path}{line}: not valid YAML ({exc.problem or exc.context}); fix it") from None
    except yaml.YAMLError as exc:
        raise DataError(f"{path}: not valid YAML ({exc}); fix it") from None


def read_dataset_yaml(folder: Path) -> EnergonDataset:
    """The sample type and field map of an Energon folder, refusing what cannot be read without Energon's code."""
    source = folder / META / "dataset.yaml"
    spec = _load_yaml(source)
    if not isinstance(spec, dict):
        raise DataError(f"{source}: not a mapping; write sample_type and field_map as `energon prepare` does")
    if spec.get("__class__") == _CRUDE:
        return EnergonDataset(None, {}, source)
    kind = spec.get("sample_type")
    module, name = (kind.get("__module__"), kind.get("__class__")) if isinstance(kind, dict) else (None, None)
    if kind is None and spec.get("__class__") in _LEGACY_CLASSES:
        module, name = spec.get("__module__"), _LEGACY_CLASSES[spec["__class__"]]
    if module != "megatron.energon" or name not in SAMPLE_TYPES:
        raise DataError(
            f"{source}: sample type {module}.{name} is not supported; use one of "
            f"{', '.join(SAMPLE_TYPES)} (megatron.energon) or {_CRUDE}"
        )
    if "sample_loader" in spec:
        raise DataError(
            f"{source}: a sample_loader is code paratron does not run; describe the fields with a field_map "
            f"({', '.join(SAMPLE_TYPES[name])}) instead"
        )
    fields = spec.get("field_map")
    if not (isinstance(fields, dict) and all(isinstance(v, str) for v in fields.values())):
        raise DataError(f"{source}: no field_map of strings; map the fields {', '.join(SAMPLE_TYPES[name])} to files")
    needed = [f for f in SAMPLE_TYPES[name] if not f.startswith("[")]
    missing = [f for f in needed if f not in fields]
    if missing:
        raise DataError(f"{source}: the field_map of {name} lacks {', '.join(missing)}; map each to a file of a sample")
    return EnergonDataset(name, {str(k): v for k, v in fields.items()}, source)


def split_shards(folder: Path, split: str) -> tuple[list[Path], set[str]]:
    """The shards of `split` in order, and what `exclude` leaves out (shard paths and "SHARD/KEY", relative)."""
    source = folder / META / "split.yaml"
    spec = _load_yaml(source)
    parts = spec.get("split_parts") if isinstance(spec, dict) else None
    if not isinstance(parts, dict):
        raise DataError(f"{source}: no split_parts mapping; write split_parts: {{train: [SHARD, ...], ...}}")
    if split not in parts:
        raise DataError(
            f"{folder}:{split}: no split {split!r} in {source}; the splits are {', '.join(map(str, parts))}"
        )
    listed = parts[split] or []
    names = [
        name for pattern in ([listed] if isinstance(listed, str) else listed) for name in expand_braces(str(pattern))
    ]
    exclude = {str(item) for item in (spec.get("exclude") or [])}
    shards = [folder / name for name in names if name not in exclude]
    for shard in shards:
        if not shard.is_file():
            raise DataError(f"{shard}: no such shard (split {split!r} of {source}); fix split.yaml or restore it")
    if not shards:
        raise DataError(f"{source}: the split {split!r} holds no shards; give it some or pick another split")
    return shards, exclude


def shard_counts(folder: Path) -> tuple[dict[str, int], Path] | None:
    """The samples per shard (relative path) that `energon prepare` counted, or None when neither info file exists."""
    for name in (".info.json", ".info.yaml"):
        path = folder / META / name
        if path.is_file():
            try:
                info = json.loads(path.read_text()) if name.endswith("json") else _load_yaml(path)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(f"{path}: not valid JSON ({exc}); rerun `energon prepare` on {folder}") from None
            counts = info.get("shard_counts") if isinstance(info, dict) else None
            if not isinstance(counts, dict):
                raise DataError(f"{path}: no shard_counts mapping; rerun `energon prepare` on {folder}")
            try:
                return {str(k): int(v) for k, v in counts.items()}, path
            except (TypeError, ValueError):
                raise DataError(f"{path}: a shard count is not a number; rerun `energon prepare` on {folder}") from None
    return None


def energon_samples(folder: Path, split: str) -> Iterator[ShardSample]:
    """The samples of a split, less those excluded, each shard's count checked against the info file."""
    shards, exclude = split_shards(folder, split)
    counts = shard_counts(folder)
    for shard in shards:
        name, found = Path(os.path.relpath(shard, folder)).as_posix(), 0
        for sample in iter_shard_samples(shard):
            found += 1
            if f"{name}/{sample.key}" not in exclude:
                yield sample
        if counts is not None and counts[0].get(name, found) != found:
            raise DataError(
                f"{shard}: holds {found} samples but {counts[1]} counted {counts[0][name]}; the shard changed since "
                f"`energon prepare`; rerun it on {folder}"
            )


def field_value(sample: ShardSample, dataset: EnergonDataset, name: str) -> Any:
    """The value the field map gives field `name`: an image part, or decoded text/JSON indexed as written."""
    spec = dataset.field_map[name]
    for option in spec.split(","):
        match = _FIELD.match(option.strip())
        if match is None:
            raise DataError(f"{dataset.source}: field_map {name}: {spec!r} is not EXT or EXT[key][index]...; fix it")
        ext, keys = match.group(1), re.findall(r"\[([^\[\]]+)\]", match.group(2))
        if ext not in sample.parts:
            continue
        value: Any = sample.parts[ext] if is_image_part(ext) else decode_text(sample, ext)
        try:
            for key in keys:
                value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        return value
    raise DataError(f"{sample.where}: nothing at {spec!r} for the field {name} ({dataset.source}); fix the sample")


def _image(value: Any, sample: ShardSample, name: str) -> ShardPart:
    if not isinstance(value, ShardPart):
        raise DataError(f"{sample.where}: the field {name} is not an image file of the sample; map it to one (jpg)")
    return value


def record_reader(dataset: EnergonDataset) -> SampleReader:
    """How a sample of this dataset becomes a conversation and its images."""
    if dataset.sample_type is None:
        return plain_record
    readers: dict[str, Callable[[ShardSample, EnergonDataset], tuple[VisionRecord, list[ShardPart]]]] = {
        "CaptioningSample": _captioning,
        "VQASample": _vqa,
        "SimilarityInterleavedSample": _interleaved,
    }
    read = readers[dataset.sample_type]
    return lambda sample: read(sample, dataset)


def _captioning(sample: ShardSample, dataset: EnergonDataset) -> tuple[VisionRecord, list[ShardPart]]:
    images = [_image(field_value(sample, dataset, "image"), sample, "image")]
    return caption_record(field_value(sample, dataset, "caption"), images, sample), images


def _vqa(sample: ShardSample, dataset: EnergonDataset) -> tuple[VisionRecord, list[ShardPart]]:
    images = [_image(field_value(sample, dataset, "image"), sample, "image")]
    weights = field_value(sample, dataset, "answer_weights") if "answer_weights" in dataset.field_map else None
    question, answers = field_value(sample, dataset, "context"), field_value(sample, dataset, "answers")
    return vqa_record(question, answers, weights, images, sample), images


def _interleaved(sample: ShardSample, dataset: EnergonDataset) -> tuple[VisionRecord, list[ShardPart]]:
    """Megatron-LM's SFT samples: `texts` LLaVA's turns, `images` one file (default: all of the sample's); the
    tags `<image-N>` (1-based) name the image at each place."""
    if "images" in dataset.field_map:
        images = [_image(field_value(sample, dataset, "images"), sample, "images")]
    else:
        images = sample.images()
    turns = field_value(sample, dataset, "texts")
    if not (isinstance(turns, list) and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns)):
        raise DataError(f"{sample.where}: texts must be a list of {{'from': ..., 'value': ...}} turns; fix the sample")
    tags = [int(n) for turn in turns for n in _IMAGE_TAG.findall(turn["value"])]
    if tags:
        if not all(1 <= n <= len(images) for n in tags):
            raise DataError(f"{sample.where}: a tag <image-N> names no image of the {len(images)}; fix the tag")
        images = [images[n - 1] for n in tags]
        turns = [{**turn, "value": _IMAGE_TAG.sub(PLACEHOLDER, turn["value"])} for turn in turns]
    return conversation_record(turns, images, sample), images


def read_energon(
    folder: Path, split: str, template: ChatTemplate, tokenizer: Tokenizer, settings: ImageSettings
) -> list[VisionConversation]:
    """The conversations of one split of an Energon dataset, checked and tokenized before training starts."""
    reader = record_reader(read_dataset_yaml(folder))
    return tokenize_shard_samples(energon_samples(folder, split), reader, template, tokenizer, settings)
