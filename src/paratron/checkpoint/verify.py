"""Finding a training checkpoint and checking it before anything loads: the newest intact one of a save
directory (a damaged one is passed over, and why is kept), every file present and its checksum the one
meta.json lists, the configuration it was saved with. Nothing is unpickled: meta.json is JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from paratron.checkpoint.files import TRACKER, file_sha256
from paratron.config.loading import config_from_dict
from paratron.config.schema import Config
from paratron.errors import CheckpointError, UserError


@dataclass
class CheckpointInfo:
    path: Path
    iteration: int
    consumed_samples: int
    config: Config
    weights_only: bool = False
    """Only weights, no training state (converted from Hugging Face): training starts from them at step 0."""
    hf_model_type: str | None = None
    """The Hugging Face architecture it was converted from, if any (kept for the way back)."""
    passed_over: list[str] = field(default_factory=list)
    """Why newer checkpoints of the same save directory were not used (damaged)."""


def holds_checkpoint(path: Path) -> bool:
    """Whether a directory holds anything a checkpoint leaves (a tracker, an iteration folder, a
    checkpoint's meta.json, Megatron-LM's `release` folder), intact or not."""
    if not path.is_dir():
        return False
    marks = (path / TRACKER, path / "meta.json", path / "release")
    return any(mark.exists() for mark in marks) or any(path.glob("iter_*"))


def _candidates(path: Path) -> list[Path]:
    """Iteration folders to try, best first: the folder itself; or the tracker's, then the other
    complete ones of a save directory, newest first."""
    if (path / "meta.json").is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory; check --load")
    tracker = path / TRACKER
    others = sorted((p for p in path.glob("iter_*") if (p / "meta.json").is_file()), reverse=True)
    first: list[Path] = []
    if tracker.is_file():
        try:
            first = [path / f"iter_{int(tracker.read_text().strip()):07d}"]
        except ValueError:
            pass
    folders = first + [p for p in others if p not in first]
    if not folders:
        raise CheckpointError(f"{path}: no checkpoint here (neither {TRACKER} nor meta.json); check --load")
    return folders


def read_checkpoint(path: Path, verify: bool = True) -> CheckpointInfo:
    """Locate a checkpoint and (unless verify=False) check every file's checksum; loads no tensors.

    Given a save directory, a damaged newest checkpoint (missing, truncated or corrupted files) is
    passed over for the newest good one, and `CheckpointInfo.passed_over` says why; given one
    iteration folder, damage is an error."""
    problems: list[str] = []
    for folder in _candidates(path):
        try:
            info = _read_folder(folder, verify)
        except CheckpointError as exc:
            if folder == path:
                raise
            problems.append(str(exc))
            continue
        info.passed_over = problems
        return info
    raise CheckpointError(
        f"{path}: no intact checkpoint ({problems[0]}"
        + (f", and {len(problems) - 1} more" if len(problems) > 1 else "")
        + ")"
    )


def _read_folder(folder: Path, verify: bool) -> CheckpointInfo:
    if not (folder / "meta.json").is_file():
        raise CheckpointError(f"{folder}: missing or incomplete; the checkpoint is damaged")
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        files: dict[str, str] = meta["files"]
    except (ValueError, KeyError):
        raise CheckpointError(f"{folder / 'meta.json'}: unreadable; the checkpoint is damaged") from None
    for name, digest in files.items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing; the checkpoint is incomplete")
        if verify and file_sha256(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch; the file is corrupted")
    try:
        config = config_from_dict(meta["config"])
    except UserError as exc:
        raise CheckpointError(f"{folder / 'meta.json'}: its config does not load ({exc})") from None
    return CheckpointInfo(
        folder,
        int(meta["iteration"]),
        int(meta["consumed_samples"]),
        config,
        bool(meta.get("weights_only", False)),
        meta.get("hf_model_type"),
    )
