"""Pruning a save directory: old checkpoints deleted (--keep-last, --save-retain-interval), each renamed
out of sight first, so no reader meets a half-deleted one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def prune_checkpoints(root: Path, keep: int, retain_interval: int | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints under `root` (none with `keep` 0), and
    with `retain_interval` all but the newest and those whose step is a multiple of it (Megatron-LM's
    --save-retain-interval); each is first renamed out of sight, so no reader meets a half-deleted
    one. Returns what was deleted."""
    complete = sorted(p for p in root.glob("iter_*") if p.is_dir() and (p / "meta.json").exists())
    doomed = complete[:-keep] if keep > 0 else []
    if retain_interval:
        doomed += [p for p in complete[:-1] if p not in doomed and int(p.name[5:]) % retain_interval]
    for path in doomed:
        hidden = root / f".old-{path.name}-{os.getpid()}"
        path.replace(hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return doomed
