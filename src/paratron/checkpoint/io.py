"""Saving and loading training checkpoints.

Layout (Megatron-LM's tracker file and iteration folders):

    SAVE/latest_checkpointed_iteration.txt      newest complete checkpoint
    SAVE/iter_0000200/model.safetensors         weights under their single-device names
    SAVE/iter_0000200/training_state.pt         optimizer, RNG and loss-scaler state (tensors and numbers only)
    SAVE/iter_0000200/tokenizer.json            the run's tokenizer, if it has one
    SAVE/iter_0000200/meta.json                 iteration, consumed samples, config, checksums

A checkpoint is written into a temporary folder and renamed into place before the
tracker moves, so a crash mid-save never leaves a half checkpoint behind the tracker.
Loading never unpickles arbitrary objects: safetensors, `torch.load(weights_only=True)`, JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from paratron.config.loading import config_from_dict, config_to_dict
from paratron.config.schema import Config
from paratron.errors import CheckpointError, UserError
from paratron.parallel.sharding import full_shape, gather_full, take_slice

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class CheckpointInfo:
    path: Path
    iteration: int
    consumed_samples: int
    config: Config


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def full_state(model: nn.Module, tp_group: Any = None) -> dict[str, torch.Tensor]:
    """Every parameter once (a tied output weight appears as the embedding), whole: tensor-parallel
    slices are gathered from the other ranks (collective over `tp_group`)."""
    return {name: gather_full(param, tp_group) for name, param in model.named_parameters()}


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """Generator states of the CPU and, on an accelerator, of this process's device."""
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state["device"], device)


def save_checkpoint(root: Path, iteration: int, consumed_samples: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None, config: Config, tokenizer: Any = None,
                    extra_state: dict[str, Any] | None = None, writer: bool = True, tp_group: Any = None) -> Path:
    """Write iteration `iteration` under `root` (by the writer rank; all ranks take part and wait).

    Weights are stored whole, under their single-device names. `extra_state` (numbers,
    tensors, dicts of them) is stored with the optimizer state and returned by
    `load_training_state`. The optimizer state is the writer's own (whole under data
    parallelism; sharded layouts keep theirs in sharded checkpoints)."""
    final = root / f"iter_{iteration:07d}"
    state_tensors = full_state(model, tp_group)
    if writer:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tensors = {name: t.contiguous().cpu() for name, t in state_tensors.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        device = next(model.parameters()).device
        state: dict[str, Any] = {"rng": rng_state(device), "extra": extra_state or {}}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        torch.save(state, tmp / "training_state.pt")
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer.json")
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        meta = {"iteration": iteration, "consumed_samples": consumed_samples,
                "config": config_to_dict(config), "files": files}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        if final.exists():  # re-saving an iteration: keep the old one until the new one is in place
            old = root / f".old-{final.name}-{os.getpid()}"
            final.replace(old)
            tmp.replace(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.replace(final)
        _write_text_atomic(root / TRACKER, f"{iteration}\n")
    if dist.is_initialized():
        dist.barrier()
    return final


def resolve_checkpoint(path: Path) -> Path:
    """A save directory (follow its tracker) or one iteration folder -> the iteration folder."""
    if (path / "meta.json").is_file():
        return path
    tracker = path / TRACKER
    if not tracker.is_file():
        raise CheckpointError(f"{path}: no checkpoint here (neither {TRACKER} nor meta.json); check --load")
    try:
        iteration = int(tracker.read_text().strip())
    except ValueError:
        raise CheckpointError(f"{tracker}: does not hold an iteration number; the checkpoint is damaged") from None
    folder = path / f"iter_{iteration:07d}"
    if not (folder / "meta.json").is_file():
        raise CheckpointError(f"{folder}: missing or incomplete; the checkpoint is damaged")
    return folder


def read_checkpoint(path: Path) -> CheckpointInfo:
    """Locate and verify a checkpoint (checksums of every file) without loading tensors."""
    folder = resolve_checkpoint(path)
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        files: dict[str, str] = meta["files"]
    except (ValueError, KeyError):
        raise CheckpointError(f"{folder / 'meta.json'}: unreadable; the checkpoint is damaged") from None
    for name, digest in files.items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing; the checkpoint is incomplete")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch; the file is corrupted")
    try:
        config = config_from_dict(meta["config"])
    except UserError as exc:
        raise CheckpointError(f"{folder / 'meta.json'}: its config does not load ({exc})") from None
    return CheckpointInfo(folder, int(meta["iteration"]), int(meta["consumed_samples"]), config)


def load_model_weights(info: CheckpointInfo, model: nn.Module) -> None:
    """Copy the checkpoint's (whole) weights into `model`, each rank taking its slice; refuses a
    checkpoint of another shape."""
    device = next(model.parameters()).device
    tensors = load_file(str(info.path / "model.safetensors"), device=str(device))
    expected = dict(model.named_parameters())
    for name, param in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{info.path}: has no tensor {name}; it belongs to a different model")
        if tuple(tensors[name].shape) != full_shape(param):
            raise CheckpointError(f"{info.path}: {name} has shape {list(tensors[name].shape)} there but "
                                  f"{list(full_shape(param))} in this model; use the same model settings")
    extra = set(tensors) - set(expected)
    if extra:
        raise CheckpointError(f"{info.path}: has tensors this model lacks ({sorted(extra)[0]}, ...); "
                              "it belongs to a different model")
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(take_slice(tensors[name], param))


def load_training_state(info: CheckpointInfo, optimizer: torch.optim.Optimizer | None,
                        device: torch.device) -> dict[str, Any]:
    """Restore the optimizer and the RNG states; return the `extra_state` saved with them."""
    state = torch.load(info.path / "training_state.pt", map_location="cpu", weights_only=True)
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{info.path}: holds no optimizer state to resume from")
        optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"], device)
    return state.get("extra", {})
