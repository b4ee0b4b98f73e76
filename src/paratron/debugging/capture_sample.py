"""The layout-independent part of a capture: which elements of a single-device tensor are kept,
what one rank holds of them, and how rank 0 puts the ranks' pieces back together.

A tensor of the single-device model is described by its full shape; a rank holds a piece of it
described per dimension by a table from single-device coordinate to local coordinate (-1 where
the rank holds nothing; None: the whole dimension, in order). Tensor-parallel column splits,
sequence-parallel and context-parallel sequence splits, vocabulary padding and expert shards
are all such tables, so one routine serves every layout (`param_tables` for a parameter; which
rank's copy of a gradient counts: `owns_gradient`). The kept elements are a fixed choice
of flat indices of the single-device tensor (all of them when it is small), the same in every
run, so two layouts compare element by element; exact statistics of the whole tensor (rms,
largest magnitude) travel with them, so a difference outside the kept elements still shows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from paratron.parallel.sharding import ParamInfo, param_info, place

SAMPLE_SEED = 1234
"""The seed of the kept elements' choice (with the tensor's size: the same choice in every run)."""

AGREEMENT_TOL = 1e-6
"""Relative difference above which the tensor-parallel ranks' copies of a replicated output disagree."""

Tables = Sequence[torch.Tensor | None]


def sample_indices(shape: Sequence[int], limit: int) -> torch.Tensor:
    """The flat indices kept of a single-device tensor of `shape`: all of them up to `limit`
    elements, else `limit` seeded random ones (sorted, without repeats), the same in every run."""
    numel = math.prod(shape)
    if numel <= limit:
        return torch.arange(numel, dtype=torch.int64)
    generator = torch.Generator().manual_seed(SAMPLE_SEED + numel)
    return torch.randint(numel, (limit,), generator=generator, dtype=torch.int64).unique(sorted=True)


def range_table(full_size: int, pairs: Sequence[tuple[slice, slice]]) -> torch.Tensor:
    """A dimension's table from (single-device range, local range) pairs with explicit bounds."""
    table = torch.full((full_size,), -1, dtype=torch.int64)
    for whole, mine in pairs:
        table[whole.start : whole.stop] = torch.arange(mine.start, mine.stop, dtype=torch.int64)
    return table


def position_table(full_size: int, positions: torch.Tensor) -> torch.Tensor:
    """A dimension's table when local coordinate i holds single-device coordinate positions[i]."""
    table = torch.full((full_size,), -1, dtype=torch.int64)
    table[positions.to(torch.int64).cpu()] = torch.arange(positions.numel(), dtype=torch.int64)
    return table


@dataclass
class Piece:
    """What one rank holds of one captured tensor (plain CPU tensors: sent to rank 0 as an object)."""

    kind: str
    """"forward" (a module's output) or "gradient" (a parameter's)."""
    name: str
    key: tuple[int, int]
    """(block of the model: 0 before the layers, 1 + layer number, a large number for the head; order on its rank)."""
    shape: tuple[int, ...]
    """The single-device tensor's shape."""
    positions: torch.Tensor
    """Which entries of `sample_indices(shape, limit)` this rank holds."""
    values: torch.Tensor
    sum_squares: float
    max_abs: float
    count: int
    owner: bool = True
    """The piece counts toward the tensor; False: a tensor-parallel replica kept to check that the ranks agree."""


def _held_mask(local_shape: Sequence[int], tables: Tables) -> torch.Tensor:
    """Which local elements lie in the single-device tensor (not padding, not a part it does not hold)."""
    mask = torch.ones(tuple(local_shape), dtype=torch.bool)
    for dim, table in enumerate(tables):
        if table is None:
            continue
        along = torch.zeros(local_shape[dim], dtype=torch.bool)
        along[table[table >= 0]] = True
        view = [1] * len(local_shape)
        view[dim] = local_shape[dim]
        mask &= along.view(view)
    return mask


def take_piece(
    kind: str,
    name: str,
    key: tuple[int, int],
    local: torch.Tensor,
    tables: Tables,
    full_shape: Sequence[int],
    limit: int,
    flat_range: tuple[int, int] | None = None,
    local_shape: Sequence[int] | None = None,
    owner: bool = True,
) -> Piece:
    """This rank's piece of a single-device tensor. `local` is the rank's tensor, laid out by
    `tables`; with `flat_range` = (start, end) it is only elements [start, end) of the flattened
    local tensor of `local_shape` (a distributed optimizer's shard of a gradient)."""
    local_shape = tuple(local.shape if local_shape is None else local_shape)
    flat = local.detach().reshape(-1).float().cpu()
    start, end = flat_range if flat_range is not None else (0, flat.numel())
    indices = sample_indices(full_shape, limit)
    coords = torch.unravel_index(indices, tuple(full_shape)) if indices.numel() else ()
    held = torch.ones(indices.numel(), dtype=torch.bool)
    local_coords = []
    for dim, table in enumerate(tables):
        c = coords[dim] if table is None else table[coords[dim]]
        held &= c >= 0
        local_coords.append(c.clamp(min=0))
    local_flat = torch.zeros(indices.numel(), dtype=torch.int64)
    for dim, c in enumerate(local_coords):
        local_flat = local_flat * local_shape[dim] + c
    held &= (local_flat >= start) & (local_flat < end)
    positions = held.nonzero().flatten()
    values = flat[local_flat[positions] - start]
    kept = flat[_held_mask(local_shape, tables).reshape(-1)[start:end]]
    sum_squares = float(kept.double().square().sum()) if kept.numel() else 0.0
    max_abs = float(kept.abs().max()) if kept.numel() else 0.0
    return Piece(kind, name, key, tuple(full_shape), positions, values, sum_squares, max_abs, kept.numel(), owner)


@dataclass
class Captured:
    """One tensor of the single-device model, as rank 0 assembles it from the ranks' pieces."""

    kind: str
    name: str
    key: tuple[int, int]
    shape: tuple[int, ...]
    values: torch.Tensor
    """The kept elements (NaN where no rank held one)."""
    rms: float
    max_abs: float
    disagreement: float = 0.0
    """Largest relative difference between tensor-parallel ranks' copies of a replicated output (0: they agree)."""
    notes: list[str] = field(default_factory=list)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def assemble(pieces: Sequence[Piece], limit: int) -> list[Captured]:
    """Every captured tensor from all ranks' pieces, ordered by key (forward: call order; gradients: as named)."""
    by_tensor: dict[tuple[str, str], list[Piece]] = {}
    for piece in pieces:
        by_tensor.setdefault((piece.kind, piece.name), []).append(piece)
    out = []
    for (kind, name), group in by_tensor.items():
        owners = [p for p in group if p.owner]
        first = (owners or group)[0]
        values = torch.full((sample_indices(first.shape, limit).numel(),), float("nan"))
        for p in owners:
            values[p.positions] = p.values
        count = sum(p.count for p in owners)
        rms = math.sqrt(sum(p.sum_squares for p in owners) / count) if count else float("nan")
        captured = Captured(
            kind, name, first.key, first.shape, values, rms, max((p.max_abs for p in owners), default=0)
        )
        if count != math.prod(first.shape):
            captured.notes.append(f"the ranks held {count} of its {math.prod(first.shape)} elements")
        for replica in (p for p in group if not p.owner):
            mine = values[replica.positions]
            stats = abs(math.sqrt(replica.sum_squares / max(replica.count, 1)) - rms) / max(rms, 1e-30)
            captured.disagreement = max(captured.disagreement, _relative(replica.values, mine), stats)
        if captured.disagreement <= AGREEMENT_TOL:
            captured.disagreement = 0.0
        out.append(captured)
    return sorted(out, key=lambda c: c.key)


def owns_gradient(info: ParamInfo, fully_sharded: bool, zero_stage: int, coords: dict[str, int]) -> bool:
    """Whether a rank at `coords` (tp, dp, cp; etp, edp) counts its copy of a parameter's gradient,
    so that every element is counted once: one tensor-parallel holder of each slice; without ZeRO
    one data-parallel replica; with ZeRO 1 and 2 every rank's shard; with ZeRO 3 (`fully_sharded`:
    FSDP2's rows) every data-parallel rank's rows, which the context-parallel ranks share (FSDP2
    shards over the data-parallel group only). An expert's slices are over the expert-tensor-
    parallel ranks (each distinct) and its replicas over the expert-data-parallel ones, which ZeRO
    shards it over."""
    if info.expert_shard is not None:
        return zero_stage in (1, 2) or (zero_stage == 3 and fully_sharded) or coords.get("edp", 0) == 0
    shard, tp_rank, cp_rank = info.shard, coords.get("tp", 0), coords.get("cp", 0)
    tp_first = tp_rank == 0 if shard is None else (info.layout or (shard,)).index(shard) == tp_rank
    if zero_stage in (1, 2):
        return tp_first
    if zero_stage == 3 and fully_sharded:
        return tp_first and cp_rank == 0
    return tp_first and coords.get("dp", 0) == 0 and cp_rank == 0


def param_tables(param: torch.Tensor, shape: tuple[int, ...]) -> Tables:
    """A parameter's tables from its place in the single-device tensor (tensor-parallel slice, expert shard)."""
    if param_info(param).shard is None and param_info(param).expert_shard is None:
        return [None] * len(shape)
    per_dim: list[list[tuple[slice, slice]]] = [[] for _ in shape]
    for whole, mine in place(param):
        for dim, (w, m) in enumerate(zip(whole, mine)):
            w = slice(*w.indices(shape[dim])[:2])
            m = slice(*m.indices(param.shape[dim])[:2])
            if (w, m) not in per_dim[dim]:
                per_dim[dim].append((w, m))
    return [range_table(shape[d], pairs) for d, pairs in enumerate(per_dim)]
