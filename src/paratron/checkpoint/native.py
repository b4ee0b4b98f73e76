"""paratron's own checkpoint as one end of a conversion: its reader (any saved checkpoint) and its
writer (a converted checkpoint: weights, tokenizer, optimizer state when the source has one, and
`model.yaml`). Written checkpoints are ordinary ones, so `paratron train --load` reads them at
any layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from paratron.checkpoint.converted import (
    Converted,
    ConvertOptions,
    build_converted,
    checkpoint_tensors,
    file_bytes,
    write_recipe,
)
from paratron.checkpoint.files import file_sha256
from paratron.checkpoint.load import weight_catalog
from paratron.checkpoint.optimizer_state import INDEX as OPTIMIZER_INDEX
from paratron.checkpoint.optimizer_state import load_optimizer, optimizer_file, write_index
from paratron.checkpoint.save import CONVERTED, CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.storage import FOLDER_SLACK, new_folder, save_tensors, tensor_bytes


def read_paratron(source: Path, options: ConvertOptions) -> Converted:
    """A paratron checkpoint (a save directory or one iteration folder), its tensors opened on demand."""
    info = read_checkpoint(source)
    tokenizer = info.path / "tokenizer.json"
    return Converted(
        path=info.path,
        config=info.config,
        open_tensors=lambda: checkpoint_tensors(info),
        given=source,
        tokenizer_file=tokenizer if tokenizer.is_file() else None,
        hf_model_type=info.hf_model_type,
        iteration=info.iteration,
        consumed_samples=info.consumed_samples,
        meta={"weights_only": info.weights_only},
    )


def write_paratron(model: Converted, destination: Path, options: ConvertOptions) -> Path:
    """Write a paratron checkpoint of a converted model; returns its iteration folder."""
    built = build_converted(model)
    params = dict(built.named_parameters())
    needed = (
        tensor_bytes(list(params.values()))
        + file_bytes(model.tokenizer_file)
        + tensor_bytes(model.optimizer or {})
        + FOLDER_SLACK
    )
    with new_folder(CONVERTED, destination, needed, options.fix) as tmp:
        content = CheckpointContent(
            model.iteration,
            model.consumed_samples,
            model.config,
            built,
            tokenizer=model.tokenizer,
            extra_meta=model.meta,
        )
        folder = save_checkpoint(tmp, content, what=CONVERTED, fix=options.fix)
        if model.optimizer is not None:
            write_converted_optimizer(folder, model.optimizer, params, model.optimizer_step)
        write_recipe(tmp, model.config)
    return destination / folder.name


def write_converted_optimizer(
    folder: Path, state: dict[str, dict[str, torch.Tensor]], params: dict[str, Any], step: int
) -> None:
    """paratron's optimizer files (one process's: whole tensors) from converted optimizer state, and
    the checksums in meta.json brought up to date (Adam's step count is `step`, not the saved entries)."""
    kept = {key: per for key, per in state.items() if key != "step"}
    tensors = {f"{key}/{name}": t.float().contiguous() for key, per in kept.items() for name, t in per.items()}
    shapes = {name: list(p.shape) for name, p in params.items()}
    file = optimizer_file(0, 0, 0)
    save_tensors(tensors, folder / file, {"format": "pt"})
    write_index(folder, {file: list(tensors)}, shapes, float(step))
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta["files"].update({name: file_sha256(folder / name) for name in (file, OPTIMIZER_INDEX)})
    meta_path.write_text(json.dumps(meta, indent=2), encoding="utf-8")


def load_converted_optimizer(folder: Path, optimizer: Any, model: Any) -> bool:
    """Fill `optimizer` from a converted checkpoint's optimizer state, when it has any (a converted
    checkpoint has no random-generator state: the run's generators start from its seed)."""
    if not (folder / OPTIMIZER_INDEX).is_file():
        return False
    with weight_catalog(read_checkpoint(folder, verify=False)) as weights:
        load_optimizer(folder, optimizer, model, weights)
    return True
