"""The fine-tuning data of a run: the --data-path entries (tasks) turned into samples.

Each entry is a task: a `.jsonl` file of conversations (rendered with --chat-template and tokenized
on every run; fine for small sets), or the prefix of a `paratron preprocess --sft` dataset
(tokenized once). With a vision model, a `.json` or `.jsonl` file of image-text conversations
(LLaVA's form or the messages form; `data.vision`), webdataset shards (a `.tar`, a folder of them or
a pattern `shard_{000..003}.tar`) or a Megatron-Energon folder (`FOLDER` or `FOLDER:SPLIT`).
As for pretraining, `--data-path A B` cuts each task by --split and blends the tasks by their sizes
(samples per epoch), `--data-path 0.7 A 0.3 B` by the weights; `--train-data-path` / `--valid-data-path`
give each split its own tasks, used whole.
Every task keeps its own validation samples, so evaluation reports a loss per task.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratron.config.schema import Config
from paratron.data.blending import BlendedDataset, component_sizes, parse_blend, split_ranges
from paratron.data.datasets import SampleSource
from paratron.data.sft.dataset import ConversationStore, SFTDataset, sft_dataset_exists
from paratron.data.sft.templates import ChatTemplate, tokenizer_chat_template
from paratron.data.sft.tokenize import TokenizedConversation, tokenize_file
from paratron.data.tokenizer import AnyTokenizer, Tokenizer
from paratron.data.vision.dataset import VisionSFTDataset
from paratron.data.vision.energon import energon_folder, read_energon
from paratron.data.vision.images import ImageSettings
from paratron.data.vision.llava import read_vision_file
from paratron.data.vision.settings import image_settings
from paratron.data.vision.shards import is_shard_source, read_shards
from paratron.errors import DataError

Log = Callable[[str], None]
BuildOnce = Callable[[Path, Callable[[Path], None]], None]


@dataclass
class SFTSources:
    train: SampleSource
    valid: SampleSource | None
    valid_tasks: dict[str, SampleSource]
    truncated: tuple[int, int] = (0, 0)
    """(training conversations cut to --seq-length, training conversations), for the run's summary."""


class _Subset(Sequence[TokenizedConversation]):
    """Some of a task's conversations (one split), in order."""

    def __init__(self, conversations: Sequence[TokenizedConversation], indices: np.ndarray) -> None:
        self.conversations, self.indices = conversations, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> TokenizedConversation:  # type: ignore[override]
        return self.conversations[int(self.indices[i])]


def task_name(path: str) -> str:
    """A task's name in logs and reports: the file's (or dataset prefix's) last component, sans suffix."""
    return Path(path).stem if Path(path).suffix in (".jsonl", ".json", ".ndjson") else Path(path).name


def load_task(
    path: str, template: ChatTemplate, tokenizer: Tokenizer, images: VisionData | None = None
) -> Sequence[TokenizedConversation]:
    """A task's conversations: a preprocessed dataset's, or a file's (with `images`: an image-text file's, webdataset
    shards' or a Megatron-Energon folder's, its images checked and their placeholders expanded)."""
    if images is not None:
        energon = energon_folder(path)
        if energon is not None:
            return read_energon(*energon, template, tokenizer, images.settings)
        if is_shard_source(path):
            return read_shards(path, template, tokenizer, images.settings)
        if not Path(path).is_file():
            raise DataError(
                f"{path}: not a .json or .jsonl file of image-text conversations, webdataset shards or an Energon "
                "folder; check the path"
            )
        return read_vision_file(Path(path), template, tokenizer, images.settings, images.folder)
    if sft_dataset_exists(path):
        return ConversationStore(path)
    if Path(path).is_file():
        return tokenize_file(Path(path), template, tokenizer)
    raise DataError(
        f"{path}: neither a .jsonl file of conversations nor a `paratron preprocess --sft` dataset prefix; "
        "check the path"
    )


def unique_task_names(paths: list[str]) -> list[str]:
    names = [task_name(p) for p in paths]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def sft_sources(
    config: Config,
    tokenizer: AnyTokenizer,
    train_samples: int,
    valid_samples: int,
    cache_dir: Path,
    build_once: BuildOnce,
    log: Log,
) -> SFTSources:
    """A run's conversations: the training blend of `train_samples`, and its validation sets (one per task, and
    their blend) when the run evaluates."""
    template = tokenizer_chat_template(config.data.chat_template, tokenizer)
    assert isinstance(tokenizer, Tokenizer)
    images = vision_data(config, tokenizer)

    def dataset(conversations: Sequence[TokenizedConversation], samples: int | None, name: str) -> SFTDataset:
        return make_dataset(config, tokenizer, images, conversations, samples, name)

    tasks = _split_tasks(config, lambda path: load_task(path, template, tokenizer, images))
    train, truncated = _training_blend(config, tasks, train_samples, dataset, cache_dir, build_once, log)
    if config.training.eval_iters == 0:
        return SFTSources(train, None, {}, truncated)
    valid, valid_tasks = _validation_sets(config, tasks, valid_samples, dataset, cache_dir, build_once)
    return SFTSources(train, valid, valid_tasks, truncated)


@dataclass
class _Tasks:
    """A run's tasks, split: each task's training and validation conversations, names and blend weights."""

    train: list[Sequence[TokenizedConversation]]
    names: list[str]
    weights: list[float] | None
    valid: list[Sequence[TokenizedConversation]]
    valid_names: list[str]


def _split_tasks(config: Config, load: Callable[[str], Sequence[TokenizedConversation]]) -> _Tasks:
    """--data-path's tasks cut by --split, or --train-data-path's and --valid-data-path's tasks as they are."""
    d = config.data
    if d.data_path:
        blend = parse_blend(d.data_path)
        tasks = [load(p) for p in blend.paths]
        names = unique_task_names(blend.paths)
        cuts = [split_ranges(len(task), d.split) for task in tasks]
        train_parts = [_Subset(task, cut[0]) for task, cut in zip(tasks, cuts)]
        valid_parts = [_Subset(task, cut[1]) for task, cut in zip(tasks, cuts)]
        return _Tasks(train_parts, names, blend.weights, valid_parts, names)
    train_blend = parse_blend(d.train_data_path, "--train-data-path")
    train_parts = [load(p) for p in train_blend.paths]
    valid_parts, valid_names = [], []
    if d.valid_data_path:
        valid_blend = parse_blend(d.valid_data_path, "--valid-data-path")
        valid_parts = [load(p) for p in valid_blend.paths]
        valid_names = unique_task_names(valid_blend.paths)
    return _Tasks(train_parts, unique_task_names(train_blend.paths), train_blend.weights, valid_parts, valid_names)


def _training_blend(
    config: Config,
    tasks: _Tasks,
    size: int,
    dataset: Callable[[Sequence[TokenizedConversation], int | None, str], SFTDataset],
    cache_dir: Path,
    build_once: BuildOnce,
    log: Log,
) -> tuple[SampleSource, tuple[int, int]]:
    """The training blend of `size` samples, and (conversations cut to --seq-length, conversations)."""
    for part, name in zip(tasks.train, tasks.names):
        if len(part) == 0:
            raise DataError(f"{name}: no conversations fall in the train split; change --split")
    epochs = [dataset(p, None, n) for p, n in zip(tasks.train, tasks.names)]
    train = _blend(epochs, tasks.weights, size, dataset, tasks.names, cache_dir, build_once)
    truncated = (sum(e.truncated for e in epochs), sum(len(e.conversations) for e in epochs))
    if truncated[0]:
        log(
            f"{truncated[0]} of {truncated[1]} training conversation(s) longer than --seq-length "
            f"{config.data.seq_length} were truncated (--no-truncate refuses them)"
        )
    return train, truncated


def _validation_sets(
    config: Config,
    tasks: _Tasks,
    size: int,
    dataset: Callable[[Sequence[TokenizedConversation], int | None, str], SFTDataset],
    cache_dir: Path,
    build_once: BuildOnce,
) -> tuple[SampleSource | None, dict[str, SampleSource]]:
    """Each task's validation set (each sample once, in order, when the run evaluates whole sets; else `size`
    samples), and the one the run evaluates: the only task's, or their blend."""
    whole = config.training.eval_batches(True) is None  # (each validation sample once, in order)
    valid_tasks = {}
    for part, name in zip(tasks.valid, tasks.valid_names):
        if len(part) == 0:
            raise DataError(
                f"{name}: no conversations fall in the validation split; change --split, give --valid-data-path, "
                "or set --eval-iters 0"
            )
        valid_tasks[name] = dataset(part, None if whole else size, name)
    valid = next(iter(valid_tasks.values())) if len(valid_tasks) == 1 else None
    if valid is None and valid_tasks:
        sizes = [len(task) for task in valid_tasks.values()]
        shares = [n / sum(sizes) for n in sizes] if whole else [1.0 / len(valid_tasks)] * len(valid_tasks)
        total = sum(sizes) if whole else size
        valid = BlendedDataset(list(valid_tasks.values()), shares, total, cache_dir, build_once, tasks.valid_names)
    return valid, valid_tasks


def _blend(
    epochs: list[SFTDataset],
    weights: list[float] | None,
    size: int,
    dataset: Callable[[Sequence[TokenizedConversation], int | None, str], SFTDataset],
    names: list[str],
    cache_dir: Path,
    build_once: BuildOnce,
) -> SampleSource:
    """The training blend of `size` samples: each task reshuffled every epoch, drawn by `weights`
    (default: each task's samples per epoch, Megatron-LM's weighting by size)."""
    if len(epochs) == 1:
        return dataset(epochs[0].conversations, size, names[0])
    if weights is None:
        counts = np.asarray([e.samples_per_epoch for e in epochs], np.float64)
        weights = (counts / counts.sum()).tolist()
    sizes = component_sizes(weights, size)
    parts = [dataset(e.conversations, n, name) for e, n, name in zip(epochs, sizes, names)]
    total = sum(math.ceil(size * w) for w in weights)
    return BlendedDataset(parts, weights, total, cache_dir, build_once, [f"sft:{name}" for name in names])


def whole_tasks(config: Config, tokenizer: AnyTokenizer, paths: list[str], names: list[str]) -> list[SFTDataset]:
    """Each task's conversations once, in order (for evaluation over whole files)."""
    template = tokenizer_chat_template(config.data.chat_template, tokenizer)
    assert isinstance(tokenizer, Tokenizer)
    images = vision_data(config, tokenizer)
    return [
        make_dataset(config, tokenizer, images, load_task(path, template, tokenizer, images), None, name)
        for path, name in zip(paths, names)
    ]


@dataclass(frozen=True)
class VisionData:
    """A vision-language run's image settings and the folder its files' image paths are relative to."""

    settings: ImageSettings
    folder: Path | None


def vision_data(config: Config, tokenizer: Tokenizer) -> VisionData | None:
    """The image settings of a run whose model has a vision encoder (None without one)."""
    if not config.model.has_vision:
        return None
    folder = Path(config.data.image_folder) if config.data.image_folder else None
    return VisionData(image_settings(config, tokenizer), folder)


def make_dataset(
    config: Config,
    tokenizer: Tokenizer,
    images: VisionData | None,
    conversations: Sequence[TokenizedConversation],
    samples: int | None,
    name: str,
) -> SFTDataset:
    """Samples of one task (with their images' pixels for a vision-language model)."""
    d, seed = config.data, config.training.seed
    rest = (d.seq_length, tokenizer.pad_id, d.sft_pack, samples, seed, d.truncation(), name)
    if images is not None:
        return VisionSFTDataset(conversations, images.settings, *rest)  # type: ignore[arg-type]
    return SFTDataset(conversations, *rest)
