"""Optimizer state in a layout-free form: every rank writes the pieces it holds under the
parameter's single-device name, with where each piece lies in the single-device tensor, so the
state loads at any other tensor, pipeline or data-parallel layout and ZeRO stage.

A piece is a flat range [start, end) of this rank's tensor- (and expert-) parallel slice of a
parameter (the whole slice without ZeRO; a bucket shard's share of it under ZeRO 1/2; FSDP2's
rows under ZeRO 3). The slice itself is described by its boxes (`sharding.place`): pairs of
index ranges, in the single-device tensor and in the slice. Each piece carries the optimizer's
per-element state (Adam's two moments, SGD's momentum) and, when the weights are 16-bit, the fp32 master weights.

File: optimizer_tpTTT_ppPPP_dpDDD.safetensors per writing rank (DDD: its place among the data- and
context-parallel ranks), its metadata listing the pieces.
Loading assembles, one parameter at a time, the single-device tensor of every state from the
pieces of all files, and takes this rank's pieces of it: exact (values are copied, never
recomputed), so a resume at the same layout continues bit for bit.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from paratron.errors import CheckpointError
from paratron.optim.protocol import OptimizerPiece, TrainingOptimizer
from paratron.parallel.data.fully_sharded import local_tensor
from paratron.parallel.sharding import Shard, boxes, full_shape, is_expert, param_info, place, shard_of

PREFIX = "optimizer_"


def optimizer_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"{PREFIX}tp{tp_rank:03d}_pp{pp_rank:03d}_dp{dp_rank:03d}.safetensors"


@dataclass
class Piece:
    """One of the optimizer's pieces (`optim.protocol.OptimizerPiece`) under its parameter's name."""

    name: str
    part: OptimizerPiece
    optimizer: torch.optim.Optimizer
    """The PyTorch optimizer holding the piece's state (keyed by `part.master`)."""


def pieces(optimizer: TrainingOptimizer, model: nn.Module, duplicates: bool = False) -> list[Piece]:
    """What this rank's optimizer steps, piece by piece, with single-device names; the last
    pipeline stage's copy of a tied embedding only with `duplicates` (the first stage saves it)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    return [
        Piece(names[id(part.param)], part, optimizer.optimizer)
        for part in optimizer.pieces()
        if duplicates or not param_info(part.param).pipeline_duplicate
    ]


def _box_record(param: nn.Parameter) -> list | None:
    """The slice's boxes as JSON: [[[start, stop] per dimension in the whole], [... in the slice]], ...]."""
    record = param_info(param)
    if record.shard is None and record.expert_shard is None:
        return None
    return [[_span(whole), _span(mine)] for whole, mine in place(param)]


def _span(index: tuple[slice, ...]) -> list[list[int | None]]:
    return [[s.start, s.stop] for s in index]


def _boxes(record: dict) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]] | None:
    """A piece's boxes from its record (older checkpoints wrote one `shard` [dim, start, length])."""
    if "boxes" in record:
        if record["boxes"] is None:
            return None
        return [(tuple(slice(*s) for s in whole), tuple(slice(*s) for s in mine)) for whole, mine in record["boxes"]]
    if record.get("shard") is None:
        return None
    dim, start, length = record["shard"]
    return boxes(record["slice_shape"], Shard(dim, start, length, record["shape"][dim]))


def optimizer_snapshot(
    optimizer: TrainingOptimizer,
    model: nn.Module,
    replicated_too: bool = True,
    copy: bool = False,
    experts_only: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This rank's pieces as (tensors, metadata) for a .safetensors file. `replicated_too=False`
    leaves out parameters that every tensor-parallel rank holds whole (another rank writes them);
    `experts_only` leaves out all but the expert-parallel ones; `copy` clones the values, so that
    training may go on while they are written."""
    tensors: dict[str, torch.Tensor] = {}
    index = []
    step = None
    for piece in pieces(optimizer, model):
        part = piece.part
        if not replicated_too and shard_of(part.param) is None:
            continue
        if experts_only and not is_expert(part.param):
            continue
        state = piece.optimizer.state.get(part.master, {})
        entries = {k: v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)}
        if "step" in state:
            step = float(state["step"])
        if part.copy:
            entries["master"] = part.master.detach()
        keys = []
        for key, value in entries.items():
            flat = local_tensor(value).detach().reshape(-1).float().cpu()
            tensors[f"{len(index)}/{key}"] = flat.clone() if copy else flat.contiguous()
            keys.append(key)
        index.append(
            {
                "name": piece.name,
                "start": part.start,
                "end": part.end,
                "keys": keys,
                "slice_shape": list(part.param.shape),
                "boxes": _box_record(part.param),
                "shape": list(full_shape(part.param)),
            }
        )
    return tensors, {"pieces": json.dumps(index), "step": json.dumps(step)}


@torch.no_grad()
def load_optimizer(
    folder: Path, optimizer: TrainingOptimizer, model: nn.Module, weights: Callable[[str], torch.Tensor] | None = None
) -> None:
    """Fill this rank's optimizer state (and fp32 masters) from every optimizer file in `folder`,
    whatever layout wrote them. `weights(name)` gives a parameter's saved single-device weights,
    for masters when the checkpoint has none (it was trained in fp32)."""
    files = sorted(folder.glob(f"{PREFIX}*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: holds no optimizer state; use --no-load-optim to start a fresh one")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files]
        by_name: dict[str, list[tuple[Any, int, dict]]] = {}
        step = None
        for handle in handles:
            meta = handle.metadata()
            step = json.loads(meta["step"]) if json.loads(meta["step"]) is not None else step
            for i, record in enumerate(json.loads(meta["pieces"])):
                by_name.setdefault(record["name"], []).append((handle, i, record))
        mine: dict[str, list[Piece]] = {}
        for piece in pieces(optimizer, model, duplicates=True):
            mine.setdefault(piece.name, []).append(piece)
        for name, targets in mine.items():
            sources = by_name.get(name)
            if not sources:
                raise CheckpointError(f"{folder}: has no optimizer state for {name}; it belongs to a different model")
            full = _assemble(sources, name, folder)
            if "master" not in full and any(p.part.copy for p in targets) and weights is not None:
                full["master"] = weights(name).float()
            for piece in targets:
                _fill(piece, full, step)
    optimizer.write_back()  # the 16-bit weights from the masters just loaded


def _assemble(sources: list[tuple[Any, int, dict]], name: str, folder: Path) -> dict[str, torch.Tensor]:
    """Single-device tensors of every saved state of parameter `name`, from its pieces."""
    shape = sources[0][2]["shape"]
    slices: dict[tuple, tuple[dict[str, torch.Tensor], list | None]] = {}  # one slice -> its flat tensors, boxes
    for handle, i, record in sources:
        if record["shape"] != shape:
            raise CheckpointError(f"{folder}: optimizer state of {name} has two shapes; the checkpoint is damaged")
        key = (json.dumps(record.get("boxes", record.get("shard"))), tuple(record["slice_shape"]))
        flats, _ = slices.setdefault(key, ({}, _boxes(record)))
        size = 1
        for n in record["slice_shape"]:
            size *= n
        for state_key in record["keys"]:
            flat = flats.setdefault(state_key, torch.zeros(size))
            flat[record["start"] : record["end"]] = handle.get_tensor(f"{i}/{state_key}")
    full: dict[str, torch.Tensor] = {}
    for (_, slice_shape), (flats, boxes_of_slice) in slices.items():
        for state_key, flat in flats.items():
            local = flat.view(slice_shape)
            target = full.setdefault(state_key, torch.zeros(shape))
            if boxes_of_slice is None:
                target.copy_(local)
            for whole, mine in boxes_of_slice or ():
                target[whole] = local[mine]
    return full


def _fill(piece: Piece, full: dict[str, torch.Tensor], step: float | None) -> None:
    """Set `piece`'s optimizer state (and master) from single-device tensors."""
    part = piece.part
    flats = {}
    for key, tensor in full.items():
        local = torch.zeros(tuple(part.param.shape))  # (a DTensor's shape is its tensor-parallel slice's)
        for whole, mine in place(part.param):  # (one box, the whole tensor, when it is not split)
            local[mine] = tensor[whole]
        flats[key] = local.reshape(-1)[part.start : part.end]
    if "master" in flats and part.copy:
        local_tensor(part.master).view(-1).copy_(flats.pop("master"))
    flats.pop("master", None)
    if not flats:
        return
    state = piece.optimizer.state[part.master]
    for key, values in flats.items():
        if key not in state:
            state[key] = torch.zeros_like(part.master, memory_format=torch.preserve_format)
        local_tensor(state[key]).view(-1).copy_(values.to(local_tensor(part.master).device))
    if step is not None:
        state["step"] = torch.tensor(step, dtype=torch.float32)
