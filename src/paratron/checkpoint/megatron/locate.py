"""Finding a Megatron-LM checkpoint: its format (legacy `torch`, `torch_dist`, `fsdp_dtensor`, or a paratron one), the
iteration folder its tracker file names, its rank files, and the args and counters it records.
Only that much is read here (no weights); `--load` checks it cheaply before any worker starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratron.checkpoint.files import TRACKER
from paratron.checkpoint.megatron.fsdp_dtensor import FSDP_DTENSOR, fsdp_objects, is_fsdp_dtensor
from paratron.checkpoint.megatron.unpickle import safe_load
from paratron.checkpoint.verify import read_checkpoint
from paratron.errors import CheckpointError

MEGATRON_FILE = "model_optim_rng.pt"
RELEASE = "release"


@dataclass
class MegatronCheckpoint:
    """One Megatron-LM checkpoint folder (`iter_NNNNNNN` or `release`) and what it says of itself."""

    folder: Path
    format: str
    """torch (legacy, one pickle per model-parallel rank), torch_dist or fsdp_dtensor."""
    iteration: int
    args: dict[str, Any]
    consumed_samples: int = 0
    common: dict[str, Any] = field(default_factory=dict)
    """The pickled dict of the first rank (legacy), common.pt (torch_dist) or the pickled objects (fsdp_dtensor)."""
    loaded: dict[tuple[int, int], dict[str, Any]] | None = None
    """Every rank file of a legacy checkpoint once read (`legacy.legacy_files`)."""


def detect_format(path: Path) -> str:
    """torch, torch_dist, fsdp_dtensor or paratron for a save directory or one iteration folder (one-line error
    for anything else). A paratron save directory is recognised by any intact iteration folder, so
    that a damaged newest one is passed over as paratron's reader does."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory; check --load")
    if (path / "meta.json").is_file() or any((p / "meta.json").is_file() for p in path.glob("iter_*")):
        return "paratron"
    megatron_marks = (path / "metadata.json", path / ".metadata", path / TRACKER)
    if not any(mark.is_file() for mark in megatron_marks) and not any(path.glob("mp_rank_*")):
        if (path / "config.json").is_file():
            raise CheckpointError(
                f"{path}: a Hugging Face model folder, not a checkpoint; convert it once with paratron convert "
                f"--from hf {path} --to paratron CKPT and give --load CKPT"
            )
        raise CheckpointError(
            f"{path}: no checkpoint here (neither {TRACKER} nor meta.json, nor Megatron-LM's mp_rank_* folders "
            "or metadata.json); check --load"
        )
    folder = iteration_folder(path)
    if (folder / "meta.json").is_file():
        return "paratron"
    return folder_format(folder)


def folder_format(folder: Path) -> str:
    metadata = folder / "metadata.json"
    if metadata.is_file():
        try:
            backend = json.loads(metadata.read_text(encoding="utf-8")).get("sharded_backend")
        except ValueError:
            raise CheckpointError(f"{metadata}: not valid JSON; the checkpoint is damaged") from None
        if backend == "torch_dist":
            return "torch_dist"
        raise CheckpointError(
            f"{folder}: sharded backend {backend!r} is not read; only torch_dist, fsdp_dtensor and torch are"
        )
    if is_fsdp_dtensor(folder):
        return FSDP_DTENSOR
    if (folder / ".metadata").is_file():
        return "torch_dist"
    if any(p.name.startswith("mp_rank_") for p in folder.iterdir()):
        return "torch"
    raise CheckpointError(
        f"{folder}: neither a Megatron-LM checkpoint (no mp_rank_* folders or metadata.json) nor a paratron one"
    )


def iteration_folder(path: Path) -> Path:
    """The folder the tracker file names (`iter_NNNNNNN` or `release`), or `path` itself."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    tracker = path / TRACKER
    if not tracker.is_file():
        if (path / "metadata.json").is_file() or (path / ".metadata").is_file() or any(path.glob("mp_rank_*")):
            return path
        raise CheckpointError(f"{path}: no {TRACKER}; give a Megatron-LM save directory or one iter_* folder")
    text = tracker.read_text(encoding="utf-8").strip()
    if text == RELEASE:
        folder = path / RELEASE
    elif text.isdigit():
        folder = path / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"{tracker}: holds {text[:40]!r}, neither an iteration number nor 'release'")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: missing, though {TRACKER} names it; the checkpoint is incomplete")
    return folder


def open_megatron(path: Path) -> MegatronCheckpoint:
    """Locate a Megatron-LM checkpoint under `path` and read its args, iteration and counters."""
    folder = iteration_folder(path)
    kind = folder_format(folder)
    if kind == "torch":
        first = rank_file(folder, 0, 0, legacy_pp(folder) > 1)
        common = safe_load(first)
    elif kind == FSDP_DTENSOR:
        common = fsdp_objects(folder)
    else:
        common = safe_load(folder / "common.pt") if (folder / "common.pt").is_file() else {}
    if not isinstance(common, dict) or not isinstance(common.get("args"), argparse.Namespace):
        raise CheckpointError(
            f"{folder}: stores no Megatron-LM args (save it with Megatron-LM's training loop, which keeps them)"
        )
    args = vars(common["args"])
    iteration = 0 if folder.name == RELEASE else int(common.get("iteration", args.get("iteration", 0)) or 0)
    consumed = int(args.get("consumed_train_samples", 0) or 0)
    return MegatronCheckpoint(folder, kind, iteration, args, consumed, common)


def legacy_pp(folder: Path) -> int:
    stages = {p.name.split("_")[3] for p in folder.glob("mp_rank_*_*")}
    return max(1, len(stages))


def rank_file(folder: Path, tp: int, pp: int, pipelined: bool) -> Path:
    name = f"mp_rank_{tp:02d}_{pp:03d}" if pipelined else f"mp_rank_{tp:02d}"
    path = folder / name / MEGATRON_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete (its args say TP/PP ranks up to it)")
    return path


# ---------------------------------------------------------------- model settings


def cache_name(source: Path, finetune: bool) -> str:
    """The name of `paratron train --load`'s converted copy of Megatron-LM checkpoint `source`
    in the data cache: its path, the iteration its tracker names (and when that was written), and
    whether only the weights are wanted."""
    folder = iteration_folder(source)
    stamp = folder.stat().st_mtime_ns
    key = hashlib.sha256(f"{source.resolve()}|{folder.name}|{stamp}|{finetune}".encode()).hexdigest()[:16]
    return f"megatron-{folder.name}-{key}"


def check_load(path: Path, declared: str | None) -> str:
    """The format of --load `path` (cheap: no tensors read), checked against --ckpt-format. A paratron
    checkpoint passes any declared format: Megatron-LM's scripts name the format their --save writes, and
    paratron saves its own there, so a script that resumes from its --save finds paratron's."""
    found = detect_format(path)
    if declared is not None and declared != found and found != "paratron":
        raise CheckpointError(f"--ckpt-format {declared}: {path} holds a {found} checkpoint; drop --ckpt-format")
    if found == "paratron":
        read_checkpoint(path, verify=False)
    elif found == "torch":
        folder = iteration_folder(path)
        rank_file(folder, 0, 0, legacy_pp(folder) > 1)
    return found
