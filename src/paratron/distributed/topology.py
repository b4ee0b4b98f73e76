"""The rank grid: which ranks share a tensor-, context-, expert-, data- or pipeline-parallel group.

Ranks are laid out in Megatron-LM's default order, fastest-varying first:

    rank = tp + TP * (cp + CP * (ep + EP * (edp + EDP * pp)))

so tensor-parallel peers are neighbours (inside one node) and pipeline stages are
farthest apart. Expert parallelism is carved out of data parallelism: the DP ranks
of a dense layer are the (ep, edp) pairs, DP = EP x EDP.

Groups are asked for by `Axis`, an enum: a misspelt kind cannot silently become a one-rank
group. Every group is a `RankGroup`, which knows its members; one whose only member is this
rank is explicit (`RankGroup.solo`) and every collective on it is a no-op by its size, not by
a missing handle.

`ParallelDims` and the rank-list arithmetic are pure (unit-tested without processes);
`Topology.create_groups` turns the lists into torch.distributed process groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

import numpy as np
import torch.distributed as dist

from paratron.config.schema import ParallelConfig

GRID = ("pp", "edp", "ep", "cp", "tp")
"""The axes of the rank grid, slowest first (the layout of numpy's C order)."""


class Axis(Enum):
    """A kind of process group: the grid axes its members differ along."""

    TP = "tp"
    """tensor parallel: ranks that split each layer's matrices"""
    CP = "cp"
    """context parallel: ranks that split each sequence"""
    EP = "ep"
    """expert parallel: ranks that hold different experts"""
    DP = "dp"
    """data parallel for dense parameters (ep x edp)"""
    EXPERT_DP = "expert_dp"
    """data parallel for expert parameters (edp)"""
    DP_CP = "dp_cp"
    """where dense gradients are reduced when context parallelism is on (edp x ep x cp)"""
    PP = "pp"
    """pipeline parallel: the stages of one pipeline"""
    MODEL = "model"
    """one replica of the model (pp x tp): gradient norms and overflow checks are summed over it"""
    EMBEDDING = "embedding"
    """the first and the last pipeline stage, which share tied embeddings"""
    WORLD = "world"
    """every rank"""


GROUP_AXES: dict[Axis, tuple[str, ...]] = {
    Axis.TP: ("tp",),
    Axis.CP: ("cp",),
    Axis.EP: ("ep",),
    Axis.DP: ("edp", "ep"),
    Axis.EXPERT_DP: ("edp",),
    Axis.DP_CP: ("edp", "ep", "cp"),
    Axis.PP: ("pp",),
    Axis.MODEL: ("pp", "tp"),
    Axis.WORLD: GRID,
}
"""The grid axes each kind of group spans (the embedding group is not a product of axes)."""


@dataclass(frozen=True)
class RankGroup:
    """One process group this rank belongs to: its members (global ranks, in group order) and
    the torch.distributed group that connects them, which is None only for this rank alone."""

    name: str
    ranks: tuple[int, ...]
    process_group: dist.ProcessGroup | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.ranks) > 1 and self.process_group is None:
            raise ValueError(
                f"the {self.name} group of ranks {list(self.ranks)} has no process group; "
                "create the groups first (Topology.create_groups)"
            )

    @classmethod
    def solo(cls, name: str = "solo", rank: int = 0) -> RankGroup:
        """A group of this rank alone: every collective over it is the identity."""
        return cls(name, (rank,))

    @classmethod
    def world(cls) -> RankGroup:
        """Every rank of the running job (this rank alone when there is no process group)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls.solo("world", dist.get_rank() if dist.is_initialized() else 0)
        return cls("world", tuple(range(dist.get_world_size())), dist.group.WORLD)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index in the group."""
        if len(self.ranks) == 1:
            return 0
        return dist.get_rank(self.process_group)

    def __repr__(self) -> str:
        return f"RankGroup({self.name}, ranks={list(self.ranks)})"


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

    @classmethod
    def from_config(cls, world_size: int, parallel: ParallelConfig) -> ParallelDims:
        """The sizes a run's --tensor-, --pipeline-, --context- and --expert-model-parallel-size ask for."""
        return cls(
            world_size,
            tp=parallel.tensor_model_parallel_size,
            pp=parallel.pipeline_model_parallel_size,
            cp=parallel.context_parallel_size,
            ep=parallel.expert_model_parallel_size,
        )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    def shape(self) -> dict[str, int]:
        return {"pp": self.pp, "edp": self.edp, "ep": self.ep, "cp": self.cp, "tp": self.tp}

    def coordinates(self, rank: int) -> dict[str, int]:
        """Position of `rank` on every grid axis (and its dp rank, which spans ep and edp)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        coords: dict[str, int] = {}
        rest = rank
        for axis in reversed(GRID):  # fastest first
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
        for axis in GRID:  # slowest first
            rank = rank * self.shape()[axis] + coords.get(axis, 0)
        return rank

    def group_ranks(self, axis: Axis) -> list[list[int]]:
        """All groups of one kind, each a sorted rank list, every rank in exactly one."""
        return [list(g) for g in _group_ranks(self, _checked(axis))]

    def _compute_group_ranks(self, axis: Axis) -> list[list[int]]:
        if axis is Axis.EMBEDDING:  # first and last stage of every pipeline
            return [sorted({g[0], g[-1]}) for g in _group_ranks(self, Axis.PP)]
        varying = GROUP_AXES[axis]
        shape = self.shape()
        grid = np.arange(self.world_size).reshape([shape[a] for a in GRID])
        fixed_axes = [i for i, a in enumerate(GRID) if a not in varying]
        varying_axes = [i for i, a in enumerate(GRID) if a in varying]
        size = int(np.prod([shape[a] for a in varying]))
        return grid.transpose(fixed_axes + varying_axes).reshape(-1, size).tolist()


def _checked(axis: Axis) -> Axis:
    if not isinstance(axis, Axis):
        known = ", ".join(f"Axis.{a.name}" for a in Axis)
        raise TypeError(f"process groups are asked for by Axis ({known}), not {axis!r}")
    return axis


@functools.lru_cache(maxsize=256)
def _group_ranks(dims: ParallelDims, axis: Axis) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in dims._compute_group_ranks(axis))


@dataclass
class Topology:
    """This rank's place in the grid and the process groups it belongs to.

    `group(axis)` returns this rank's `RankGroup` of that kind. A kind whose groups have one
    rank needs no process group and is always available; the others exist once
    `create_groups` has run (asking earlier raises).
    """

    dims: ParallelDims
    rank: int = 0
    _groups: dict[Axis, dist.ProcessGroup] = field(default_factory=dict, repr=False)
    _ranks: dict[Axis, list[int]] = field(default_factory=dict, repr=False)

    @cached_property
    def coords(self) -> dict[str, int]:
        return self.dims.coordinates(self.rank)

    def size(self, axis: Axis) -> int:
        return len(self.ranks(axis))

    def local_rank(self, axis: Axis) -> int:
        return self.ranks(axis).index(self.rank)

    def ranks(self, axis: Axis) -> list[int]:
        """The ranks of this rank's group of kind `axis`. A rank outside every group of its kind (a
        middle pipeline stage, which holds no embedding) is a group of its own."""
        if _checked(axis) not in self._ranks:
            lists = self.dims.group_ranks(axis)
            self._ranks[axis] = next((r for r in lists if self.rank in r), [self.rank])
        return self._ranks[axis]

    def group(self, axis: Axis) -> RankGroup:
        """This rank's group of kind `axis` (raises for an unknown kind, or before `create_groups`
        for one of several ranks)."""
        ranks = tuple(self.ranks(axis))
        if len(ranks) == 1:
            return RankGroup(axis.value, ranks)
        if axis not in self._groups:
            raise RuntimeError(
                f"the {axis.value} group of ranks {list(ranks)} does not exist yet; "
                "call Topology.create_groups() on every rank first"
            )
        return RankGroup(axis.value, ranks, self._groups[axis])

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    def create_groups(self) -> None:
        """Create every process group of more than one rank. Collective: all ranks call it in the same order."""
        made: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}  # kinds with the same rank lists share groups
        for axis in Axis:
            lists = self.dims.group_ranks(axis)
            if max(len(r) for r in lists) == 1:
                continue
            key = tuple(tuple(r) for r in lists)
            if key not in made:
                made[key], _ = dist.new_subgroups_by_enumeration(lists)
            self._groups[axis] = made[key]

    def create_subgroups(self, axis: Axis, chunk: int, name: str) -> RankGroup:
        """Cut every group of kind `axis` into consecutive pieces of `chunk` ranks, create them
        (collective over all ranks) and return this rank's piece, e.g. the tensor-parallel ranks
        that share a key/value head."""
        lists = [g[i : i + chunk] for g in self.dims.group_ranks(axis) for i in range(0, len(g), chunk)]
        mine = next(r for r in lists if self.rank in r)
        if chunk == 1:
            return RankGroup(name, tuple(mine))
        group, _ = dist.new_subgroups_by_enumeration(lists)
        return RankGroup(name, tuple(mine), group)

    def describe(self) -> str:
        d = self.dims
        return f"world {d.world_size} = TP {d.tp} x CP {d.cp} x DP {d.dp} (EP {d.ep}) x PP {d.pp}"
