"""Pieces of expert parallelism that need no processes: where a rank's part of a stacked expert
weight lies (experts x tensor-parallel blocks), and how arriving tokens are regrouped by expert."""

from __future__ import annotations

import torch

from paratron.parallel.expert.dispatch import _expert_major
from paratron.parallel.sharding import Shard, boxes


def test_a_rank_holds_its_experts_and_its_slice_of_both_gate_and_up_rows():
    # 4 experts of [gate 6 | up 6] x 3, EP 2, TP 3: rank (ep 1, tp 2) holds experts 2-3, rows 4-5 and 10-11
    full = torch.arange(4 * 12 * 3).view(4, 12, 3)
    tp = Shard(1, 4, 2, 12, blocks=2)
    ep = Shard(0, 2, 2, 4)
    local = torch.zeros(2, 4, 3, dtype=full.dtype)
    for whole, mine in boxes(local.shape, tp, ep):
        local[mine] = full[whole]
    assert torch.equal(local, torch.cat([full[2:4, 4:6], full[2:4, 10:12]], dim=1))


def test_boxes_of_a_whole_tensor_and_of_padding():
    assert boxes((3, 2), None) == [((slice(None), slice(None)), (slice(None), slice(None)))]
    assert boxes((4, 2), Shard(0, 8, 0, 8)) == []  # a vocabulary shard that is all padding


def test_arrivals_are_regrouped_by_expert_then_source():
    # rows arrive (source 0: expert 0 x1, expert 1 x2), (source 1: expert 0 x3, expert 1 x1)
    order = _expert_major(torch.tensor([[1, 2], [3, 1]]))
    assert order.tolist() == [0, 3, 4, 5, 1, 2, 6]
    assert _expert_major(torch.tensor([[0, 0], [0, 2]])).tolist() == [0, 1]
