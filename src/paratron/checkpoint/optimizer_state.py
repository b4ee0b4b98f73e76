"""Optimizer state in a layout-free form: every rank writes the state it holds as boxes of the
parameters' single-device tensors (`pieces.py`), so the state loads at any other tensor,
pipeline or data-parallel layout and ZeRO stage, each rank reading only what it needs.

A rank's share of a parameter's state is a flat range [start, end) of its tensor- (and expert-)
parallel slice (the whole slice without ZeRO; a bucket shard's share of it under ZeRO 1/2;
FSDP2's rows under ZeRO 3): a few boxes of the slice, hence of the single-device tensor. Each
box of each state (Adam's two moments, SGD's momentum and, when the weights are 16-bit, the
fp32 `master` weights) is one tensor, under the key `STATE/NAME[BOX]`.

File: optimizer_tpTTT_ppPPP_dpDDD.safetensors per writing rank (DDD: its place among the data- and
context-parallel ranks); `optimizer.index.json` maps every key to its file and records the
single-device shapes and the optimizer's step count. Loading copies values, never recomputes
them, so a resume at the same layout continues bit for bit. (Checkpoints written before the
boxes, with flat pieces listed in each file's metadata, still load.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from paratron.checkpoint.pieces import Catalog, box_key, flat_piece_boxes, param_piece_boxes, parse_key, writes
from paratron.distributed.topology import Topology
from paratron.errors import CheckpointError
from paratron.optim.master_weights import step_counter
from paratron.optim.protocol import OptimizerPiece, TrainingOptimizer
from paratron.parallel.data_parallel.fully_sharded import local_tensor
from paratron.parallel.sharding import Shard, boxes, full_shape, param_info, whole_box

PREFIX = "optimizer_"
INDEX = "optimizer.index.json"


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


@dataclass
class OptimizerSnapshot:
    """This rank's boxes of the optimizer state, ready for a .safetensors file and the index."""

    tensors: dict[str, torch.Tensor]
    shapes: dict[str, list[int]]
    """Single-device shape of every parameter written."""
    step: float | None


def optimizer_snapshot(
    optimizer: TrainingOptimizer, model: nn.Module, topology: Topology, sharded: bool, copy: bool = False
) -> OptimizerSnapshot:
    """The state this rank writes: of each parameter it is the writer of (`pieces.writes`; with a
    `sharded` optimizer every rank holds its own shards), every state's boxes as fp32 tensors.
    `copy` clones the values, so that training may go on while they are written."""
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    step = None
    for piece in pieces(optimizer, model):
        part = piece.part
        if not writes(part.param, topology, sharded_over_data=sharded):
            continue
        state = piece.optimizer.state.get(part.master, {})
        entries = {k: v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)}
        if "step" in state:
            step = float(state["step"])
        if part.copy:
            entries["master"] = part.master.detach()
        shape = full_shape(part.param)
        shapes[piece.name] = list(shape)
        regions = param_piece_boxes(part.param, part.start, part.end)
        for key, value in entries.items():
            flat = local_tensor(value).detach().reshape(-1)
            for whole, at, local_shape, within in regions:
                first = at - part.start
                box = flat[first : first + math.prod(local_shape)].view(local_shape)[within].float().cpu()
                tensors[f"{key}/{box_key(piece.name, whole, shape)}"] = box.clone() if copy else box.contiguous()
    return OptimizerSnapshot(tensors, shapes, step)


def write_index(folder: Path, files: dict[str, list[str]], shapes: dict[str, list[int]], step: float | None) -> None:
    """`optimizer.index.json`: every key's file (`files`: file -> its keys), the shapes, the step."""
    weight_map = {key: file for file, keys in sorted(files.items()) for key in keys}
    (folder / INDEX).write_text(
        json.dumps({"step": step, "shapes": shapes, "weight_map": weight_map}, indent=1), encoding="utf-8"
    )


@torch.no_grad()
def load_optimizer(
    folder: Path, optimizer: TrainingOptimizer, model: nn.Module, weights: Catalog | None = None
) -> None:
    """Fill this rank's optimizer state (and fp32 masters) from the checkpoint in `folder`,
    whatever layout wrote it, reading only the boxes this rank holds. `weights` (the
    checkpoint's weights) gives the masters when the checkpoint has none (it was trained in fp32)."""
    catalog, names, step = _catalog(folder)
    states: dict[str, dict[str, tuple[Catalog, str]]] = {}  # parameter -> its states' stored names
    for name in catalog.boxes:
        key, _, of = name.partition("/")
        states.setdefault(of, {})[key] = (catalog, name)
    with catalog:
        for piece in pieces(optimizer, model, duplicates=True):
            if piece.name not in names:
                raise CheckpointError(
                    f"{folder}: has no optimizer state for {piece.name}; it belongs to a different model"
                )
            sources = dict(states.get(piece.name, {}))
            if "master" not in sources and piece.part.copy and weights is not None:
                sources["master"] = (weights, piece.name)
            _fill(piece, sources, step)
    optimizer.write_back()  # the 16-bit weights from the masters just loaded


def _catalog(folder: Path) -> tuple[Catalog, set[str], float | None]:
    """The stored boxes of every state (named `STATE/NAME`), the parameter names, the step."""
    index = folder / INDEX
    if not index.is_file():
        return _older_catalog(folder)
    try:
        record = json.loads(index.read_text(encoding="utf-8"))
        weight_map: dict[str, str] = record["weight_map"]
        shapes = {name: record["shapes"][name.split("/", 1)[1]] for name in (parse_key(key)[0] for key in weight_map)}
        names, step = set(record["shapes"]), record["step"]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise CheckpointError(f"{index}: unreadable; the checkpoint is damaged") from None
    return Catalog(folder, weight_map, shapes), names, step


def _older_catalog(folder: Path) -> tuple[Catalog, set[str], float | None]:
    """Optimizer state as written before the boxes: flat pieces listed in each file's metadata,
    turned into boxes in memory."""
    files = sorted(folder.glob(f"{PREFIX}*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: holds no optimizer state; use --no-load-optim to start a fresh one")
    catalog, names, step = Catalog(folder, {}), set(), None
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            meta = handle.metadata() or {}
            if "pieces" not in meta or "step" not in meta:
                raise CheckpointError(f"{folder}: {INDEX} is missing; the checkpoint is damaged")
            step = json.loads(meta["step"]) if json.loads(meta["step"]) is not None else step
            for i, record in enumerate(json.loads(meta["pieces"])):
                names.add(record["name"])
                shape, local_shape = record["shape"], record["slice_shape"]
                pairs = _older_boxes(record) or [(whole_box(shape), whole_box(shape))]
                regions = flat_piece_boxes(local_shape, shape, pairs, record["start"], record["end"])
                for key in record["keys"]:
                    flat = handle.get_tensor(f"{i}/{key}")
                    for whole, at, box_shape, within in regions:
                        first = at - record["start"]
                        values = flat[first : first + math.prod(box_shape)].view(box_shape)[within]
                        catalog.add(f"{key}/{record['name']}", whole, values, shape)
    return catalog, names, step


def _older_boxes(record: dict) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]] | None:
    """An older piece's slice boxes from its record (the oldest wrote one `shard` [dim, start, length])."""
    if "boxes" in record:
        if record["boxes"] is None:
            return None
        return [(tuple(slice(*s) for s in whole), tuple(slice(*s) for s in mine)) for whole, mine in record["boxes"]]
    if record.get("shard") is None:
        return None
    dim, start, length = record["shard"]
    return boxes(record["slice_shape"], Shard(dim, start, length, record["shape"][dim]))


def _fill(piece: Piece, sources: dict[str, tuple[Catalog, str]], step: float | None) -> None:
    """Set `piece`'s optimizer state (and master) from the stored boxes it covers: `sources`
    names, for each state, the catalog and the stored name to read it from."""
    part = piece.part
    regions = param_piece_boxes(part.param, part.start, part.end)
    flats = {}
    for key, (source, name) in sources.items():
        flat = torch.zeros(part.end - part.start)
        for whole, at, local_shape, within in regions:
            first = at - part.start
            source.fill(name, flat[first : first + math.prod(local_shape)].view(local_shape), [(whole, within)])
        flats[key] = flat
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
        state["step"] = step_counter(piece.optimizer, part.master, step)
