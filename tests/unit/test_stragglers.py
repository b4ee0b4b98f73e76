"""--straggler-threshold: the median/threshold report, and the timed wrappers of torch.distributed's
collectives (in process, on a one-rank gloo group)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from paratron.debugging.stragglers import (
    RankFigures,
    StragglerDetector,
    TimedWork,
    _timed_batch,
    find_stragglers,
    straggler_line,
    straggler_metrics,
    wrapped_collectives,
)
from paratron.distributed.topology import ParallelDims, Topology
from paratron.training.metrics import scalars

CPU = torch.device("cpu")
TP01, TP23, DP02, DP13 = "tp group [0, 1]", "tp group [2, 3]", "dp group [0, 2]", "dp group [1, 3]"
GROUPS = {0: (TP01, DP02), 1: (TP01, DP13), 2: (TP23, DP02), 3: (TP23, DP13)}
MEMBERS = {TP01: (0, 1), TP23: (2, 3), DP02: (0, 2), DP13: (1, 3)}


def figures(step_s: dict[int, float], waits: dict[int, dict[str, float]]) -> list[RankFigures]:
    """Four ranks (TP 2 x DP 2) over 3 steps."""
    return [RankFigures(r, 3, step_s[r], waits.get(r, {}), {g: MEMBERS[g] for g in GROUPS[r]}) for r in sorted(step_s)]


def test_a_slow_rank_is_named_with_the_group_whose_peers_waited_for_it():
    # rank 3 computes 1.5 s; rank 2 waits 1.0 s for it in their TP group, rank 1 0.2 s in their DP group
    ranks = figures(
        {0: 0.6, 1: 0.8, 2: 1.6, 3: 1.5}, {0: {TP01: 0.05}, 1: {DP13: 0.2}, 2: {TP23: 1.0}, 3: {TP23: 0.01}}
    )
    found = find_stragglers(ranks, threshold=0.5)
    assert [s.rank for s in found] == [3]
    slow = found[0]
    assert slow.compute_s == pytest.approx(1.49)
    assert slow.median_s == pytest.approx(0.6)  # computes 0.55, 0.6, 0.6, 1.49: the lower middle value
    assert slow.excess == pytest.approx(1.49 / 0.6 - 1)
    assert slow.delays == ((TP23, 1.0),)  # the DP group's 0.2 s is under half of the longest wait
    line = straggler_line(9, found, steps=3)
    assert line == (
        "step 9: stragglers: rank 3 computes 0.497 s/step, 148% above the median 0.200 s/step; "
        "delays tp group [2, 3] (its peers waited 0.333 s/step)"
    )


def test_no_rank_is_named_within_the_threshold_and_both_groups_when_both_waited():
    even = figures({0: 1.0, 1: 1.1, 2: 0.95, 3: 1.05}, {})
    assert find_stragglers(even, threshold=0.2) == []
    just_over = figures({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.21}, {})
    assert find_stragglers(just_over, threshold=0.2)[0].delays == ()
    assert find_stragglers(just_over, threshold=0.25) == []
    both = figures({0: 1.0, 1: 2.0, 2: 2.0, 3: 3.0}, {1: {DP13: 0.9}, 2: {TP23: 1.0}})
    assert find_stragglers(both, threshold=0.5)[0].delays == ((TP23, 1.0), (DP13, 0.9))
    assert find_stragglers(figures({0: 1.0}, {}), threshold=0.1) == []  # one rank: no median to compare with
    jitter = figures({0: 0.033, 1: 0.043, 2: 0.033, 3: 0.034}, {})  # 30% above, but 3 ms a step: jitter
    assert find_stragglers(jitter, threshold=0.2) == []


def test_two_ranks_compare_the_slower_with_the_faster():
    # the mean of two (the plain median) is at most half way: a rank 3x slower is only 50% above it
    pair = [RankFigures(0, 1, 1.0, {"dp group [0, 1]": 0.7}, {"dp group [0, 1]": (0, 1)}), RankFigures(1, 1, 0.9)]
    (slow,) = find_stragglers(pair, threshold=0.5)
    assert (slow.rank, slow.median_s) == (1, pytest.approx(0.3))


def test_metrics_carry_every_ranks_figures_per_step_and_the_names():
    ranks = figures({0: 0.6, 1: 0.6, 2: 3.0, 3: 3.0}, {2: {TP23: 2.4}})  # 3 steps: per step a third
    record = straggler_metrics(ranks, find_stragglers(ranks, threshold=0.5))
    assert record["straggler/rank2/compute_s"] == pytest.approx(0.2)
    assert record["straggler/rank2/wait_s"] == pytest.approx(0.8)
    assert record["straggler/rank3/compute_s"] == pytest.approx(1.0)
    assert record["straggler/ranks"] == [3]
    assert record["straggler/rank3/delays"] == TP23
    assert "straggler/rank0/delays" not in record


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo world (torch.distributed's functions need one to run)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_blocking_and_async_collectives_are_charged_to_their_group_while_measuring(one_rank):
    charged: list[tuple[object, float]] = []
    measuring = [True]
    original = dist.all_reduce
    with wrapped_collectives(lambda g, s: charged.append((g, s)), lambda: measuring[0], torch.device("cpu")):
        assert dist.all_reduce is not original
        x = torch.ones(3)
        dist.all_reduce(x)
        work = dist.all_reduce(x, async_op=True)
        assert isinstance(work, TimedWork) and len(charged) == 1  # charged at the wait, not the call
        work.wait()
        assert work.is_completed()  # (the Work's own methods pass through)
        dist.barrier(group=dist.group.WORLD)
        dist.P2POp(dist.isend, x, 0)  # (torch accepts only its own isend and irecv in a P2POp)
        measuring[0] = False
        dist.all_reduce(x)
        assert not isinstance(dist.all_reduce(x, async_op=True), TimedWork)
    assert dist.all_reduce is original and dist.barrier.__module__ == "torch.distributed.distributed_c10d"
    assert [g for g, _ in charged] == [None, None, dist.group.WORLD]
    assert torch.equal(x, torch.ones(3))  # one rank: a sum of one
    assert all(s >= 0 for _, s in charged)


def test_a_wait_is_timed_for_as_long_as_it_blocks():
    class SlowWork:
        def wait(self) -> bool:
            time.sleep(0.05)
            return True

    charged = []
    work = TimedWork(SlowWork(), "group", lambda g, s: charged.append((g, s)), torch.device("cpu"))
    assert work.wait() is True
    assert charged[0][0] == "group" and 0.05 <= charged[0][1] < 1.0


def test_batched_p2p_works_are_timed_at_their_wait_charged_to_the_ops_group():
    class Op:
        group = "pp"

    class Work:
        def wait(self) -> None:
            return None

    charged = []
    timed = _timed_batch(lambda ops: [Work() for _ in ops], lambda g, s: charged.append(g), lambda: True, CPU)
    works = timed([Op(), Op()])
    for work in works:
        work.wait()
    assert charged == ["pp", "pp"]


def test_the_detector_is_off_without_a_threshold_or_on_one_rank():
    topology = Topology(ParallelDims(1), 0)
    off = StragglerDetector(None, topology, torch.device("cpu"))
    with off.instrumented(), off.timing():
        pass
    assert not off.enabled and off.steps == 0
    assert off.report(3, print) == {}


def test_tensorboard_gets_the_figures_and_not_the_group_names():
    assert scalars("train/straggler/rank1/delays", "dp group [0, 1]") == []
    assert scalars("straggler/ranks", [1, 3]) == [("straggler/ranks/0", 1.0), ("straggler/ranks/1", 3.0)]
    assert scalars("train/straggler/rank1/compute_s", 0.25) == [("train/straggler/rank1/compute_s", 0.25)]
