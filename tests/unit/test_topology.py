"""Rank arithmetic of the parallel grids, without processes, for world sizes up to 4096, and the
same groups as megatron-core's own rank generator (MoE parallel folding included)."""

from __future__ import annotations

import itertools

import pytest
from megatron.core.parallel_state import RankGenerator

from paratron.config.dims import GRIDS, GROUP_AXES, Axis, ParallelDims
from paratron.distributed.topology import RankGroup, Topology

LAYOUTS = [
    dict(world_size=1),
    dict(world_size=8, tp=2, pp=2),
    dict(world_size=16, tp=2, cp=2, pp=2),
    dict(world_size=64, tp=8, pp=4, ep=2),
    dict(world_size=4096, tp=8, pp=16, cp=2, ep=4),
    dict(world_size=4096, tp=4, pp=8),
    dict(world_size=8, tp=2, ep=4, etp=1),
    dict(world_size=16, tp=2, cp=2, pp=2, ep=4, etp=1),
    dict(world_size=256, tp=4, pp=4, ep=8, etp=2),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_groups_partition_the_world_and_agree_with_coordinates(layout):
    dims = ParallelDims(**layout)
    assert dims.tp * dims.cp * dims.dp * dims.pp == dims.world_size
    sizes = {
        Axis.TP: dims.tp,
        Axis.CP: dims.cp,
        Axis.EP: dims.ep,
        Axis.EXPERT_TP: dims.expert_tp,
        Axis.DP: dims.dp,
        Axis.EXPERT_DP: dims.edp,
        Axis.DP_CP: dims.dp * dims.cp,
        Axis.PP: dims.pp,
        Axis.MODEL: dims.tp * dims.pp,
        Axis.WORLD: dims.world_size,
    }
    coords = [dims.coordinates(r) for r in range(dims.world_size)]
    for kind, (grid, varying) in GROUP_AXES.items():
        groups = dims.group_ranks(kind)
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(dims.world_size)), f"{kind} groups do not partition the world"
        assert all(len(g) == sizes[kind] for g in groups)
        for g in groups:
            assert g == sorted(g)
            # members agree on every axis outside the group's varying axes
            fixed = [a for a in GRIDS[grid] if a not in varying]
            assert len({tuple(coords[r][a] for a in fixed) for r in g}) == 1
    for r in range(0, dims.world_size, max(1, dims.world_size // 97)):
        assert dims.rank_of(**{a: coords[r][a] for a in ("etp", "ep", "edp", "pp")}) == r
        assert dims.rank_of(tp=coords[r]["tp"], cp=coords[r]["cp"], dp=coords[r]["dp"], pp=coords[r]["pp"]) == r


def test_megatron_rank_order_tp_fastest_then_cp_ep_dp_pp():
    dims = ParallelDims(world_size=16, tp=2, cp=2, pp=2)  # dp = 2
    assert dims.group_ranks(Axis.TP)[:2] == [[0, 1], [2, 3]]
    assert dims.group_ranks(Axis.CP)[:2] == [[0, 2], [1, 3]]
    assert dims.group_ranks(Axis.DP)[:2] == [[0, 4], [1, 5]]
    assert dims.group_ranks(Axis.PP)[:2] == [[0, 8], [1, 9]]
    assert dims.coordinates(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1, "etp": 1, "ep": 0, "edp": 2}
    # tensor-parallel peers stay inside an 8-GPU node in the classic 8 x TP layout
    big = ParallelDims(world_size=512, tp=8, pp=8)
    assert all(g[-1] - g[0] == 7 and g[0] % 8 == 0 for g in big.group_ranks(Axis.TP))


def test_expert_parallel_is_carved_out_of_data_parallel_when_experts_share_the_tensor_split():
    dims = ParallelDims(world_size=16, tp=2, ep=2)  # dp = 8 = ep 2 x edp 4
    assert dims.group_ranks(Axis.EP)[0] == [0, 2]
    assert dims.group_ranks(Axis.EXPERT_DP)[0] == [0, 4, 8, 12]
    assert dims.group_ranks(Axis.DP)[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert dims.group_ranks(Axis.EXPERT_TP) == dims.group_ranks(Axis.TP)


def test_folded_experts_span_tensor_and_context_parallel_ranks():
    dims = ParallelDims(world_size=8, tp=2, cp=2, ep=4, etp=1)  # dp = 2, edp = 2
    assert dims.group_ranks(Axis.EP) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # tp and cp peers hold different experts
    assert dims.group_ranks(Axis.EXPERT_DP) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_ranks(Axis.EXPERT_TP) == [[r] for r in range(8)]
    assert dims.ep > dims.dp and dims.edp == 2
    described = Topology(dims, rank=5).describe()
    assert described == "world 8 = TP 2 x CP 2 x DP 2 x PP 1; experts ETP 1 x EP 4 x EDP 2 per stage"


# (world, tp, cp, pp, ep, etp): dense layouts, experts carved from DP, and folded ones (EP over TP and CP ranks,
# expert TP below, equal to and above TP), as Megatron-Core's MoE parallel folding lays them
MEGATRON_LAYOUTS = [
    (8, 2, 1, 2, 1, None),
    (16, 2, 2, 2, 1, None),
    (16, 2, 1, 1, 2, None),
    (2, 2, 1, 1, 2, 1),
    (4, 2, 1, 1, 4, 1),
    (4, 1, 2, 1, 2, 1),
    (8, 2, 1, 2, 4, 1),
    (16, 2, 2, 2, 4, 1),
    (16, 4, 1, 1, 4, 2),
    (32, 2, 2, 2, 2, 4),
    (64, 8, 1, 2, 8, 1),
    (128, 4, 2, 4, 16, 1),
]


@pytest.mark.parametrize("world, tp, cp, pp, ep, etp", MEGATRON_LAYOUTS)
def test_groups_equal_megatron_cores_rank_generator(world, tp, cp, pp, ep, etp):
    dims = ParallelDims(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    order = "tp-cp-ep-dp-pp"  # (megatron-core's default)
    dense = RankGenerator(tp=tp, ep=1, dp=dims.dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=dims.expert_tp, ep=ep, dp=dims.edp, pp=pp, cp=1, order=order)
    expected = {
        Axis.TP: dense.get_ranks("tp"),
        Axis.CP: dense.get_ranks("cp"),
        Axis.DP: dense.get_ranks("dp"),
        Axis.DP_CP: dense.get_ranks("dp-cp"),
        Axis.PP: dense.get_ranks("pp"),
        Axis.MODEL: dense.get_ranks("tp-pp"),
        Axis.EXPERT_TP: expert.get_ranks("tp"),
        Axis.EP: expert.get_ranks("ep"),
        Axis.EXPERT_DP: expert.get_ranks("dp"),
    }
    for axis, groups in expected.items():
        assert sorted(dims.group_ranks(axis)) == sorted(sorted(g) for g in groups), axis


def test_embedding_group_is_first_and_last_stage():
    dims = ParallelDims(world_size=8, tp=2, pp=4)
    assert dims.group_ranks(Axis.EMBEDDING) == [[0, 6], [1, 7]]
    topo = Topology(dims, rank=7)
    assert topo.ranks(Axis.EMBEDDING) == [1, 7] and topo.pp_rank == dims.pp - 1
    assert topo.ranks(Axis.TP) == [6, 7] and topo.local_rank(Axis.TP) == 1 and topo.size(Axis.DP) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, tp=4), "world size 6 is not divisible by TP x CP x PP = 4"),
        (
            dict(world_size=8, tp=2, ep=3),
            r"the 8 ranks of a pipeline stage \(TP x CP x DP\) are not divisible by expert-tensor-parallel x "
            "expert-parallel size = 2 x 3",
        ),
        (dict(world_size=8, tp=2, ep=8), "not divisible by expert-tensor-parallel x expert-parallel size = 2 x 8"),
        (dict(world_size=0), "world_size must be a positive integer"),
        (dict(world_size=4, pp=-1), "pp must be a positive integer"),
    ],
)
def test_invalid_dims_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank 8 is outside world size 8"):
        ParallelDims(world_size=8).coordinates(8)


def test_group_kinds_with_equal_ranks_are_listed_once_per_kind_and_cached():
    dims = ParallelDims(world_size=8, tp=2)
    assert dims.group_ranks(Axis.DP) == dims.group_ranks(Axis.DP_CP) == dims.group_ranks(Axis.EXPERT_DP)
    assert dims.group_ranks(Axis.TP) == dims.group_ranks(Axis.EXPERT_TP)
    topo = Topology(dims, rank=3)
    assert topo.ranks(Axis.DP) is topo.ranks(Axis.DP)  # computed once
    assert topo.ranks(Axis.DP) == [1, 3, 5, 7]


def test_groups_are_asked_for_by_axis_and_never_silently_missing():
    topo = Topology(ParallelDims(world_size=8, tp=2), rank=3)
    with pytest.raises(TypeError, match=r"process groups are asked for by Axis \(Axis.TP, .*\), not 'tpp'"):
        topo.group("tpp")
    with pytest.raises(TypeError, match="not 'tp'"):
        topo.ranks("tp")
    # a kind of several ranks exists only once the groups are created
    with pytest.raises(
        RuntimeError,
        match=r"the tp group of ranks \[2, 3\] does not exist yet; call "
        r"Topology.create_groups\(\)",
    ):
        topo.group(Axis.TP)
    # a one-rank kind is an explicit group of this rank alone
    solo = topo.group(Axis.PP)
    assert isinstance(solo, RankGroup) and solo.ranks == (3,) and solo.size == 1 and solo.rank == 0
    assert solo.process_group is None
    with pytest.raises(ValueError, match=r"the dp group of ranks \[1, 3\] has no process group"):
        RankGroup("dp", (1, 3))
