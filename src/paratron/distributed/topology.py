"""The rank grid: which ranks share a tensor-, context-, expert-, data- or pipeline-parallel group.

Ranks are laid out in Megatron-LM's default order, fastest-varying first:

    rank = tp + TP * (cp + CP * (ep + EP * (edp + EDP * pp)))

so tensor-parallel peers are neighbours (inside one node) and pipeline stages are
farthest apart. Expert parallelism is carved out of data parallelism: the DP ranks
of a dense layer are the (ep, edp) pairs, DP = EP x EDP.

`ParallelDims` and the rank-list arithmetic are pure (unit-tested without processes);
`Topology.create_groups` turns the lists into torch.distributed process groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

# Grid axes, slowest first (the layout of numpy's C order), and the kinds of group.
AXES = ("pp", "edp", "ep", "cp", "tp")
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "ep": ("ep",),
    "dp": ("edp", "ep"),          # data parallel for dense parameters
    "expert_dp": ("edp",),        # data parallel for expert parameters
    "dp_cp": ("edp", "ep", "cp"),  # where gradients are reduced when context parallelism is on
    "pp": ("pp",),
    "model": ("pp", "tp"),        # one replica of the model
}


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension; DP is what is left of the world after TP x CP x PP."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            raise ValueError(f"world size {self.world_size} is not divisible by TP x CP x PP = {model}")
        if self.dp % self.ep:
            raise ValueError(f"data-parallel size {self.dp} is not divisible by expert-parallel size {self.ep}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    def shape(self) -> dict[str, int]:
        return {"pp": self.pp, "edp": self.edp, "ep": self.ep, "cp": self.cp, "tp": self.tp}

    def coordinates(self, rank: int) -> dict[str, int]:
        """Position of `rank` on every axis (and its dp rank, which spans ep and edp)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        coords: dict[str, int] = {}
        rest = rank
        for axis in reversed(AXES):  # fastest first
            size = self.shape()[axis]
            coords[axis] = rest % size
            rest //= size
        coords["dp"] = coords["ep"] + self.ep * coords["edp"]
        return coords

    def rank_of(self, **coords: int) -> int:
        """Inverse of `coordinates` (axes not given are 0; `dp` may be given instead of ep/edp)."""
        if "dp" in coords:
            dp = coords.pop("dp")
            coords.setdefault("ep", dp % self.ep)
            coords.setdefault("edp", dp // self.ep)
        rank = 0
        for axis in AXES:  # slowest first
            rank = rank * self.shape()[axis] + coords.get(axis, 0)
        return rank

    def group_ranks(self, kind: str) -> list[list[int]]:
        """All groups of one kind, each a sorted rank list, every rank in exactly one."""
        return [list(g) for g in _group_ranks(self, kind)]

    def _compute_group_ranks(self, kind: str) -> list[list[int]]:
        varying = GROUP_AXES[kind]
        shape = self.shape()
        grid = np.arange(self.world_size).reshape([shape[a] for a in AXES])
        fixed_axes = [i for i, a in enumerate(AXES) if a not in varying]
        varying_axes = [i for i, a in enumerate(AXES) if a in varying]
        size = int(np.prod([shape[a] for a in varying]))
        return grid.transpose(fixed_axes + varying_axes).reshape(-1, size).tolist()

    def embedding_group_ranks(self) -> list[list[int]]:
        """First and last pipeline stage of every pipeline: they share tied embeddings."""
        return [sorted({g[0], g[-1]}) for g in _group_ranks(self, "pp")]


@functools.lru_cache(maxsize=256)
def _group_ranks(dims: ParallelDims, kind: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in dims._compute_group_ranks(kind))


@dataclass
class Topology:
    """This rank's place in the grid and the process groups it belongs to.

    Groups are None until `create_groups` runs (and stay None for size-1 groups, where
    every collective is a no-op): code asks `size(kind)` before communicating.
    """

    dims: ParallelDims
    rank: int = 0
    groups: dict[str, Any] = field(default_factory=dict)
    _ranks: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @cached_property
    def coords(self) -> dict[str, int]:
        return self.dims.coordinates(self.rank)

    def size(self, kind: str) -> int:
        return len(self.ranks(kind))

    def local_rank(self, kind: str) -> int:
        return self.ranks(kind).index(self.rank)

    def ranks(self, kind: str) -> list[int]:
        """The ranks of this rank's group of `kind`."""
        if kind not in self._ranks:
            lists = self.dims.embedding_group_ranks() if kind == "embedding" else self.dims.group_ranks(kind)
            self._ranks[kind] = next((r for r in lists if self.rank in r), [self.rank])
        return self._ranks[kind]

    def group(self, kind: str) -> Any:
        return self.groups.get(kind)

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def create_groups(self) -> None:
        """Create every process group of size > 1. Collective: all ranks call it in the same order."""
        import torch.distributed as dist

        kinds: list[tuple[str, list[list[int]]]] = [(k, self.dims.group_ranks(k)) for k in GROUP_AXES]
        kinds.append(("embedding", self.dims.embedding_group_ranks()))
        made: dict[tuple[tuple[int, ...], ...], Any] = {}  # kinds with the same rank lists share groups
        for kind, lists in kinds:
            if max(len(r) for r in lists) == 1:
                continue
            key = tuple(tuple(r) for r in lists)
            if key not in made:
                made[key], _ = dist.new_subgroups_by_enumeration(lists)
            self.groups[kind] = made[key]

    def create_subgroups(self, kind: str, chunk: int) -> Any:
        """Cut every group of `kind` into consecutive pieces of `chunk` ranks, create them
        (collective) and return this rank's piece (e.g. the TP ranks sharing a key/value head)."""
        import torch.distributed as dist

        lists = [g[i : i + chunk] for g in self.dims.group_ranks(kind) for i in range(0, len(g), chunk)]
        if chunk == 1 or not dist.is_initialized():
            return None
        mine, _ = dist.new_subgroups_by_enumeration(lists)
        return mine

    def describe(self) -> str:
        d = self.dims
        return f"world {d.world_size} = TP {d.tp} x CP {d.cp} x DP {d.dp} (EP {d.ep}) x PP {d.pp}"
