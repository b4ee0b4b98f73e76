"""The rank grid: which ranks share a tensor-, context-, data-, expert- or pipeline-parallel group.

The grids themselves (Megatron-Core's rank order tp-cp-ep-dp-pp, dense and the experts' folded
one), `Axis` and `ParallelDims` are pure arithmetic in `config/dims.py`; this module turns their
rank lists into torch.distributed process groups.

Groups are asked for by `Axis`, an enum: a misspelt kind cannot silently become a one-rank
group. Every group is a `RankGroup`, which knows its members; one whose only member is this
rank is explicit (`RankGroup.solo`) and every collective on it is a no-op by its size, not by
a missing handle.

The rank-list arithmetic is unit-tested without processes, and against megatron-core's own rank
generator; `Topology.create_groups` turns the lists into torch.distributed process groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist

from paratron.config.dims import GRIDS, GROUP_AXES, Axis, ParallelDims, checked_axis
from paratron.config.layout import Layout

__all__ = ["GRIDS", "GROUP_AXES", "Axis", "ParallelDims", "RankGroup", "Topology", "worker_topology"]


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
        if checked_axis(axis) not in self._ranks:
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
    def expert_tp_rank(self) -> int:
        return self.coords["etp"]

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
        text = f"world {d.world_size} = TP {d.tp} x CP {d.cp} x DP {d.dp} x PP {d.pp}"
        if d.ep > 1 or d.expert_tp != d.tp:
            text += f"; experts ETP {d.expert_tp} x EP {d.ep} x EDP {d.edp} per stage"
        return text


def worker_topology(layout: Layout, world_size: int, rank: int) -> Topology:
    """This rank's place on the grid of the run's layout (the one validation worked out), with every
    process group created: collective, all ranks call it."""
    if layout.world_size != world_size:
        raise RuntimeError(f"the run's layout is for {layout.world_size} ranks, but {world_size} are running")
    topology = Topology(layout.dims, rank)
    topology.create_groups()
    return topology
