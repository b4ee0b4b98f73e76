"""The model a checkpoint holds, for a run that loads it: `paratron train --load CKPT` (and `evaluate`) build
that model without model flags, and use its tokenizer when the run names none; `paratron_checkpoint` gives
train, evaluate and generate a paratron checkpoint for any --load (a Megatron-LM one converted once).

A paratron checkpoint (one converted from Hugging Face included) says its model in meta.json; a Megatron-LM
checkpoint in its saved args, read as `paratron convert` reads them, tokenizer settings included. Only that much
is read here (no weights), before any worker starts; the checks of what the run gives against it are
`config.loading.resolve_settings`'.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paratron.checkpoint.formats import hf_to_paratron, megatron_to_paratron
from paratron.checkpoint.megatron import cache_name, config_of, detect_format, open_megatron
from paratron.checkpoint.pretrained import tokenizer_from_checkpoint
from paratron.checkpoint.verify import CheckpointInfo, holds_checkpoint, read_checkpoint
from paratron.config.loading import CheckpointReader, SavedModel
from paratron.data.build import Log, build_once, cache_folder
from paratron.data.tokenizer import AnyTokenizer, load_tokenizer

MEGATRON_TOKENIZER_ARGS = (
    "tokenizer_type",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
    "tiktoken_special_tokens",
)
"""Megatron-LM args that say which tokenizer a checkpoint was trained with (paratron's settings of the same names)."""


def saved_model(load: str, save: str | None = None) -> SavedModel | None:
    """What the checkpoint at `load` says of its model; None when there is nothing to read yet: `load` is not a
    directory (the input checks name it), or it is also `save` and holds nothing (the run starts from scratch)."""
    path = Path(load).expanduser()
    if not path.is_dir():
        return None
    if save is not None and path.resolve() == Path(save).expanduser().resolve() and not holds_checkpoint(path):
        return None
    where = f"the checkpoint {load}"
    if detect_format(path) == "paratron":
        info = read_checkpoint(path, verify=False)
        return SavedModel(where, dataclasses.asdict(info.config.model))
    checkpoint = open_megatron(path)
    model = config_of(checkpoint.args, f"{checkpoint.folder} args").model
    return SavedModel(where, dataclasses.asdict(model), megatron_tokenizer(checkpoint.args, path))


def megatron_tokenizer(args: dict[str, Any], root: Path | None = None) -> dict[str, Any]:
    """The tokenizer settings of Megatron-LM `args` (those it recorded). A tokenizer file or folder
    that is no longer where the args say but beside the checkpoint (`root`: a checkpoint moved or
    copied with its tokenizer, as `paratron convert --to megatron` writes it) is taken from there."""
    settings = {name: args[name] for name in MEGATRON_TOKENIZER_ARGS if args.get(name) is not None}
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        recorded = Path(str(settings.get(name, "")))
        if name in settings and not recorded.exists() and root is not None and (root / recorded.name).exists():
            settings[name] = str(root / recorded.name)
    return settings if settings.get("tokenizer_type") else {}


def read_saved_model(settings: Mapping[str, Any]) -> SavedModel | None:
    """`config.loading.CheckpointReader` of train, evaluate and debug compare: `saved_model` of the settings' --load
    (and --save)."""
    save = settings.get("save")
    return saved_model(str(settings["load"]), None if save is None else str(save))


def converting_reader(log: Log) -> CheckpointReader:
    """`config.loading.CheckpointReader` of the commands that run the engine: a Hugging Face folder given to --load is
    converted once into the cache (`paratron_checkpoint`) and its copy is what the run loads."""

    def read(settings: Mapping[str, Any]) -> SavedModel | None:
        load = Path(str(settings["load"])).expanduser()
        if not (load.is_dir() and is_hf_folder(load)):
            return read_saved_model(settings)
        converted = str(paratron_checkpoint(load, cache_folder(settings.get("data_cache_path")), True, log=log))
        saved = saved_model(converted)
        return None if saved is None else dataclasses.replace(saved, folder=converted)

    return read


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder (config.json and weights), not a checkpoint of paratron's or Megatron-LM's."""
    checkpoint_marks = ("meta.json", "latest_checkpointed_iteration.txt", "metadata.json", ".metadata")
    return (
        (path / "config.json").is_file()
        and not any((path / mark).exists() for mark in checkpoint_marks)
        and not any(path.glob("iter_*"))
    )


def hf_cache_name(source: Path) -> str:
    """The name of a Hugging Face folder's converted copy in the data cache: its path and when its files changed."""
    stamps = sorted(f"{f.name}:{f.stat().st_mtime_ns}" for f in source.iterdir() if f.is_file())
    key = hashlib.sha256(f"{source.resolve()}|{'|'.join(stamps)}".encode()).hexdigest()[:16]
    return f"hf-{source.name}-{key}"


def paratron_checkpoint(load: Path, cache: Path, weights_only: bool, local_rank: int = 0, log: Log = print) -> Path:
    """--load as a paratron checkpoint: itself, or a Megatron-LM checkpoint or a Hugging Face model folder converted
    once (by each machine's local rank 0, the others waiting) into the `cache` folder (`data.build.cache_root`), a
    Megatron-LM one's weights only when `weights_only` (fine-tuning, evaluation, generation)."""
    if is_hf_folder(load):
        target = cache / "checkpoints" / hf_cache_name(load)
        build_once(target, lambda tmp: hf_to_paratron(load, tmp), local_rank, log)
        return target
    if detect_format(load) == "paratron":
        return load
    target = cache / "checkpoints" / cache_name(load, weights_only)
    fix = "free space, or point PARATRON_CACHE (or --data-cache-path) elsewhere"
    build_once(target, lambda tmp: megatron_to_paratron(load, tmp, finetune=weights_only, fix=fix), local_rank, log)
    return target


def saved_tokenizer(load: Path, info: CheckpointInfo) -> AnyTokenizer | None:
    """The tokenizer a checkpoint was trained with: the one saved beside a paratron checkpoint (`info`), or the one
    a Megatron-LM checkpoint's args name (at `load`, or beside it); None when neither says."""
    tokenizer = tokenizer_from_checkpoint(info)
    if tokenizer is not None or is_hf_folder(load) or detect_format(load) == "paratron":
        return tokenizer
    args = open_megatron(load).args
    settings = megatron_tokenizer(args, load)
    if not settings:
        return None
    return load_tokenizer(
        settings["tokenizer_type"],
        settings.get("tokenizer_model"),
        settings.get("vocab_file"),
        settings.get("merge_file"),
        args.get("vocab_size"),
        tiktoken_pattern=settings.get("tiktoken_pattern"),
        tiktoken_num_special_tokens=settings.get("tiktoken_num_special_tokens", 1000),
        tiktoken_special_tokens=settings.get("tiktoken_special_tokens"),
    )
