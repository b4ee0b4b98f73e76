"""Checkpoint tensors as boxes of single-device tensors, so that every rank writes only what it
holds and reads only what it needs, at any layout.

A rank holds a box (or a few) of each single-device tensor: a tensor-parallel slice, its experts,
its FSDP2 rows under ZeRO-3 (`fully_sharded.held_boxes`); a distributed optimizer's shard is a
flat range of such a slice, which is itself a few boxes (`flat_boxes`). Each box is stored as one
safetensors tensor under a key that names the tensor and the box, `layers.0.mlp.fc1.weight[0:96,0:64]`,
or the bare name when the box is the whole tensor (so a single-device checkpoint is a plain
safetensors file of single-device names). A reader intersects the boxes it needs with the saved
ones and reads only the intersections (`safe_open(...).get_slice`).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from paratron.distributed.topology import Axis, Topology
from paratron.errors import CheckpointError
from paratron.parallel.data_parallel.fully_sharded import is_sharded
from paratron.parallel.sharding import Index, bounded, box_shape, box_size, full_shape, param_info, place, whole_box

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
_BOXED = re.compile(r"^(.*)\[(\d+:\d+(?:,\d+:\d+)*)?\]$")


def box_key(name: str, box: Index, shape: Sequence[int]) -> str:
    """The key of `box` of tensor `name` (of single-device `shape`): the name alone for the whole tensor."""
    if all(s.start == 0 and s.stop == n for s, n in zip(box, shape)):
        return name
    return f"{name}[{','.join(f'{s.start}:{s.stop}' for s in box)}]"


def parse_key(key: str) -> tuple[str, Index | None]:
    """(tensor name, box) of a key; the box is None for a whole tensor."""
    match = _BOXED.match(key)
    if match is None:
        return key, None
    spans = match.group(2).split(",") if match.group(2) else []
    return match.group(1), tuple(slice(int(a), int(b)) for a, b in (span.split(":") for span in spans))


def intersect(a: Index, b: Index) -> Index | None:
    """The common part of two boxes, or None."""
    common = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return None if any(s.start >= s.stop for s in common) else common


def relative(box: Index, origin: Index) -> Index:
    """`box` in the coordinates of the box `origin` that contains it."""
    return tuple(slice(s.start - o.start, s.stop - o.start) for s, o in zip(box, origin))


def shifted(box: Index, origin: Index) -> Index:
    """A box given relative to `origin`, in absolute coordinates (the inverse of `relative`)."""
    return tuple(slice(s.start + o.start, s.stop + o.start) for s, o in zip(box, origin))


def flat_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[Index, int]]:
    """Elements [start, end) of a row-major tensor of `shape` as boxes, each with its first flat
    position: a partial first row, whole rows, a partial last row (recursively for more
    dimensions). Each box is contiguous in the flat order."""
    if start >= end:
        return []
    if not shape:
        return [((), start)]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:
        inner = flat_boxes(shape[1:], start - first * row, end - first * row)
        return [((slice(first, first + 1), *box), at + first * row) for box, at in inner]
    out: list[tuple[Index, int]] = []
    whole_from, whole_to = -(-start // row), end // row
    if start % row:
        out += flat_boxes(shape, start, whole_from * row)
    if whole_from < whole_to:
        out.append(((slice(whole_from, whole_to), *(slice(0, n) for n in shape[1:])), whole_from * row))
    if end % row:
        out += flat_boxes(shape, whole_to * row, end)
    return out


def writes(param: torch.Tensor, topology: Topology, sharded_over_data: bool = False) -> bool:
    """Whether this rank writes what it holds of `param`: exactly one of the ranks that hold the
    same values does. Those are the tensor-parallel ranks of a tensor not split over them (or
    holding the same slice), and the data-parallel replicas unless the values are sharded over
    them: FSDP2's rows of a weight under ZeRO-3, or a distributed optimizer's shards
    (`sharded_over_data`). An expert's weights live on the experts' grid: its slices over the
    expert-tensor-parallel ranks, its replicas over the expert-data-parallel ones."""
    record = param_info(param)
    if record.pipeline_duplicate:
        return False
    expert = record.expert_shard is not None
    shard, tp_rank = record.shard, topology.expert_tp_rank if expert else topology.tp_rank
    if shard is None:
        first_of_tp = tp_rank == 0
    else:  # (several tensor-parallel ranks may hold the same key/value heads: the first writes)
        same = [r for r, s in enumerate(record.layout or ()) if (s.start, s.length) == (shard.start, shard.length)]
        first_of_tp = not same or same[0] == tp_rank
    if sharded_over_data or is_sharded(param):
        return first_of_tp
    if expert:
        return first_of_tp and topology.coords["edp"] == 0
    return first_of_tp and topology.local_rank(Axis.DP_CP) == 0


def flat_piece_boxes(
    local_shape: Sequence[int], shape: Sequence[int], pairs: Sequence[tuple[Index, Index]], start: int, end: int
) -> list[tuple[Index, int, tuple[int, ...], Index]]:
    """Where elements [start, end) of a flattened local tensor of `local_shape` lie in the
    single-device tensor of `shape`, given the local tensor's (single-device index, local index)
    `pairs` (`sharding.place`): (box of the single-device tensor, first flat position and shape
    of the contiguous local box holding it, its place in that local box) for each part; padding
    is in none."""
    out = []
    for local_box, at in flat_boxes(local_shape, start, end):
        for whole, mine in pairs:
            whole, mine = bounded(whole, shape), bounded(mine, local_shape)
            common = intersect(local_box, mine)
            if common is not None:
                whole_part = shifted(relative(common, mine), whole)
                out.append((whole_part, at, box_shape(local_box), relative(common, local_box)))
    return out


def param_piece_boxes(param: torch.Tensor, start: int, end: int) -> list[tuple[Index, int, tuple[int, ...], Index]]:
    """`flat_piece_boxes` of elements [start, end) of a parameter's (tensor-parallel-local) tensor."""
    return flat_piece_boxes(tuple(param.shape), full_shape(param), place(param), start, end)


def _covered(whole: Index, parts: Sequence[Index]) -> int:
    """How many elements of box `whole` the boxes `parts` (inside it) cover: their sizes summed
    when no two overlap (as every rank writes distinct boxes), else (or when there are too many
    to compare pairwise) counted on a mask of the box (a byte per element, the values' size or less)."""
    few = len(parts) <= 64
    if few and not any(intersect(a, b) is not None for i, a in enumerate(parts) for b in parts[i + 1 :]):
        return sum(box_size(part) for part in parts)
    mask = torch.zeros(box_shape(whole), dtype=torch.bool)
    for part in parts:
        mask[relative(part, whole)] = True
    return int(mask.sum())


@dataclass(frozen=True)
class SavedBox:
    """One stored box of a single-device tensor: in file `file` under `key`."""

    file: str
    key: str
    box: Index
    tensor: torch.Tensor | None = None
    """The values themselves, for boxes assembled in memory (an older checkpoint's flat pieces)."""


class Catalog:
    """Every stored box of every tensor of one kind (weights, or one optimizer state) in a
    checkpoint folder, by tensor name, with the tensors' single-device shapes; opens files only
    when a box of theirs is read, and keeps them open until `close`."""

    def __init__(self, folder: Path, keys: dict[str, str], shapes: dict[str, list[int]] | None = None) -> None:
        """`keys`: key -> file name (relative to `folder`); `shapes`: single-device shapes, needed
        only for tensors stored in boxes (a whole tensor's shape is read from its file)."""
        self.folder = folder
        self.shapes = {name: tuple(shape) for name, shape in (shapes or {}).items()}
        self.boxes: dict[str, list[SavedBox]] = {}
        self._open = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        try:
            for key, file in keys.items():
                name, box = parse_key(key)
                if box is None:
                    shape = tuple(self._slice(file, key).get_shape())
                    self.shapes[name] = shape
                    box = whole_box(shape)
                elif name not in self.shapes:
                    raise CheckpointError(f"{folder}: no shape recorded for {name}; the checkpoint is damaged")
                self.boxes.setdefault(name, []).append(SavedBox(file, key, box))
        except BaseException:
            self.close()
            raise

    def add(self, name: str, box: Index, values: torch.Tensor, shape: Sequence[int]) -> None:
        """Add a box held in memory."""
        self.shapes[name] = tuple(shape)
        self.boxes.setdefault(name, []).append(SavedBox("", name, box, values))

    def read(self, piece: SavedBox, part: Index) -> torch.Tensor:
        """`part` (relative to the box) of a stored box."""
        if piece.tensor is not None:
            return piece.tensor[part]
        try:
            return self._slice(piece.file, piece.key)[part]
        except SafetensorError as exc:
            raise CheckpointError(
                f"{self.folder / piece.file}: unreadable ({exc}); the checkpoint is damaged"
            ) from None

    def _slice(self, file: str, key: str) -> Any:
        """Lazy access to tensor `key` of `file` (safetensors' slice object)."""
        try:
            return self.handle(file).get_slice(key)
        except SafetensorError:
            raise CheckpointError(f"{self.folder / file}: has no tensor {key}; the checkpoint is damaged") from None

    def handle(self, file: str) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = self._open.enter_context(
                    safe_open(str(self.folder / file), framework="pt", device="cpu")
                )
            except (OSError, RuntimeError, SafetensorError) as exc:
                raise CheckpointError(f"{self.folder / file}: unreadable ({exc}); the checkpoint is damaged") from None
        return self._handles[file]

    def close(self) -> None:
        self._open.close()
        self._handles = {}

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self.boxes

    def fill(self, name: str, target: torch.Tensor, wanted: Iterable[tuple[Index, Index]]) -> None:
        """Copy the saved values of tensor `name` into `target`: `wanted` pairs a box of the
        single-device tensor with the box of `target` it goes to. Reads only those ranges;
        refuses a checkpoint that does not hold all of them."""
        saved = self.boxes.get(name)
        if saved is None:
            raise CheckpointError(f"{self.folder}: has no tensor {name}; it belongs to a different model")
        shape = self.shapes[name]
        for whole, into in wanted:
            whole = bounded(whole, shape)
            parts = []
            for piece in saved:
                common = intersect(whole, piece.box)
                if common is not None:
                    target[shifted(relative(common, whole), into)] = self.read(piece, relative(common, piece.box))
                    parts.append(common)
            found = _covered(whole, parts)
            if found < box_size(whole):
                raise CheckpointError(
                    f"{self.folder}: holds only {found} of the {box_size(whole)} values of {name} this rank needs; "
                    "the checkpoint is incomplete"
                )

    def whole(self, name: str) -> torch.Tensor:
        """The single-device tensor `name`, assembled from its boxes."""
        saved = self.boxes.get(name)
        if not saved:
            raise CheckpointError(f"{self.folder}: has no tensor {name}; it belongs to a different model")
        first = saved[0]
        dtype = (
            first.tensor.dtype
            if first.tensor is not None
            else _DTYPES[self.handle(first.file).get_slice(first.key).get_dtype()]
        )
        out = torch.empty(self.shapes[name], dtype=dtype)
        everything = whole_box(self.shapes[name])
        self.fill(name, out, [(everything, everything)])
        return out
