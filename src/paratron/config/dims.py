"""The rank grid as pure arithmetic: the size of every parallel axis and which ranks share a tensor-,
context-, data-, expert- or pipeline-parallel group, with no process started.

Ranks are laid out as Megatron-Core lays them (its `RankGenerator`, order tp-cp-ep-dp-pp),
fastest-varying first, on two grids over the same ranks:

    dense layers   rank = tp + TP * (cp + CP * (dp + DP * pp))
    experts        rank = etp + ETP * (ep + EP * (edp + EDP * pp))

so tensor-parallel peers are neighbours (inside one node) and pipeline stages are farthest
apart. The experts' grid is MoE parallel folding: inside each pipeline stage the experts lay
their own expert-tensor x expert x expert-data-parallel grid over the stage's TP x CP x DP
ranks (ETP x EP x EDP = TP x CP x DP), so an expert-parallel group may span tensor- and
context-parallel ranks, and EP may exceed DP. With ETP = TP and CP = 1 expert parallelism is
carved out of data parallelism (dp = ep + EP * edp).

`ParallelDims` is the one place the data-parallel sizes (dp, edp) are worked out: the run's
`config.layout.Layout` carries one, and `distributed.topology.Topology` turns its rank lists
into process groups. Groups are asked for by `Axis`, an enum: a misspelt kind cannot silently
become a one-rank group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

import numpy as np

from paratron.config.schema import ParallelConfig

DENSE_GRID = ("pp", "dp", "cp", "tp")
"""The axes of the dense layers' grid, slowest first (the layout of numpy's C order)."""

EXPERT_GRID = ("pp", "edp", "ep", "etp")
"""The axes of the experts' grid over the same ranks, slowest first."""

GRIDS = {"dense": DENSE_GRID, "expert": EXPERT_GRID}


class Axis(Enum):
    """A kind of process group: the grid axes its members differ along."""

    TP = "tp"
    """tensor parallel: ranks that split each layer's matrices"""
    CP = "cp"
    """context parallel: ranks that split each sequence"""
    EP = "ep"
    """expert parallel: ranks that hold different experts (on the experts' grid)"""
    EXPERT_TP = "expert_tp"
    """expert tensor parallel: ranks that split each expert's matrices (on the experts' grid)"""
    DP = "dp"
    """data parallel for dense parameters"""
    EXPERT_DP = "expert_dp"
    """data parallel for expert parameters: the ranks that hold the same experts (on the experts' grid)"""
    DP_CP = "dp_cp"
    """where dense gradients are reduced when context parallelism is on (dp x cp)"""
    PP = "pp"
    """pipeline parallel: the stages of one pipeline"""
    MODEL = "model"
    """one replica of the model (pp x tp): gradient norms and overflow checks are summed over it"""
    EMBEDDING = "embedding"
    """the first and the last pipeline stage, which share tied embeddings"""
    WORLD = "world"
    """every rank"""


GROUP_AXES: dict[Axis, tuple[str, tuple[str, ...]]] = {
    Axis.TP: ("dense", ("tp",)),
    Axis.CP: ("dense", ("cp",)),
    Axis.DP: ("dense", ("dp",)),
    Axis.DP_CP: ("dense", ("dp", "cp")),
    Axis.PP: ("dense", ("pp",)),
    Axis.MODEL: ("dense", ("pp", "tp")),
    Axis.EP: ("expert", ("ep",)),
    Axis.EXPERT_TP: ("expert", ("etp",)),
    Axis.EXPERT_DP: ("expert", ("edp",)),
    Axis.WORLD: ("dense", DENSE_GRID),
}
"""The grid and its axes each kind of group spans (the embedding group is not a product of axes)."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension. DP is what is left of the world after TP x CP x PP; the
    experts' grid folds ETP x EP x EDP over each stage's TP x CP x DP ranks (ETP defaults to TP)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    """expert tensor-parallel size (None: the tensor-parallel size, as Megatron-Core defaults it)"""

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            raise ValueError(f"world size {self.world_size} is not divisible by TP x CP x PP = {model}")
        stage = self.world_size // self.pp
        if stage % (self.expert_tp * self.ep):
            raise ValueError(
                f"the {stage} ranks of a pipeline stage (TP x CP x DP) are not divisible by expert-tensor-parallel x "
                f"expert-parallel size = {self.expert_tp} x {self.ep}"
            )

    @classmethod
    def from_config(cls, world_size: int, parallel: ParallelConfig) -> ParallelDims:
        """The sizes a run's --tensor-, --pipeline-, --context-, --expert-model- and
        --expert-tensor-parallel-size ask for."""
        return cls(
            world_size,
            tp=parallel.tensor_model_parallel_size,
            pp=parallel.pipeline_model_parallel_size,
            cp=parallel.context_parallel_size,
            ep=parallel.expert_model_parallel_size,
            etp=parallel.expert_tensor_parallel_size,
        )

    @property
    def expert_tp(self) -> int:
        assert self.etp is not None  # (set in __post_init__)
        return self.etp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    def shape(self, grid: str = "dense") -> dict[str, int]:
        """The size of each axis of one grid ("dense" or "expert")."""
        if grid == "expert":
            return {"pp": self.pp, "edp": self.edp, "ep": self.ep, "etp": self.expert_tp}
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def coordinates(self, rank: int) -> dict[str, int]:
        """Position of `rank` on every axis of both grids (pp is the same on both)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        coords: dict[str, int] = {}
        for grid, axes in GRIDS.items():
            rest, shape = rank, self.shape(grid)
            for axis in reversed(axes):  # fastest first
                coords[axis] = rest % shape[axis]
                rest //= shape[axis]
        return coords

    def rank_of(self, **coords: int) -> int:
        """Inverse of `coordinates`: the rank at these positions of one grid (the experts' when an
        expert axis is given); axes not given are 0."""
        grid = "expert" if {"etp", "ep", "edp"} & coords.keys() else "dense"
        unknown = coords.keys() - set(GRIDS[grid])
        if unknown:
            raise ValueError(f"axes {sorted(unknown)} are not on the {grid} grid {GRIDS[grid]}")
        rank, shape = 0, self.shape(grid)
        for axis in GRIDS[grid]:  # slowest first
            rank = rank * shape[axis] + coords.get(axis, 0)
        return rank

    def group_ranks(self, axis: Axis) -> list[list[int]]:
        """All groups of one kind, each a sorted rank list, every rank in exactly one."""
        return [list(g) for g in _group_ranks(self, checked_axis(axis))]

    def _compute_group_ranks(self, axis: Axis) -> list[list[int]]:
        if axis is Axis.EMBEDDING:  # first and last stage of every pipeline
            return [sorted({g[0], g[-1]}) for g in _group_ranks(self, Axis.PP)]
        grid_name, varying = GROUP_AXES[axis]
        axes, shape = GRIDS[grid_name], self.shape(grid_name)
        grid = np.arange(self.world_size).reshape([shape[a] for a in axes])
        fixed_axes = [i for i, a in enumerate(axes) if a not in varying]
        varying_axes = [i for i, a in enumerate(axes) if a in varying]
        size = int(np.prod([shape[a] for a in varying]))
        return grid.transpose(fixed_axes + varying_axes).reshape(-1, size).tolist()


def checked_axis(axis: Axis) -> Axis:
    """`axis`, or TypeError when it is not an `Axis` (a misspelt kind must not become a one-rank group)."""
    if not isinstance(axis, Axis):
        known = ", ".join(f"Axis.{a.name}" for a in Axis)
        raise TypeError(f"process groups are asked for by Axis ({known}), not {axis!r}")
    return axis


@functools.lru_cache(maxsize=256)
def _group_ranks(dims: ParallelDims, axis: Axis) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in dims._compute_group_ranks(axis))
