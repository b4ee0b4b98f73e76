"""Gradient bucket layout: backward order, bucket sizes, padding for shards, late parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratron.distributed.topology import RankGroup
from paratron.parallel.data_parallel.buckets import GradientReducer, plan_buckets


def params(*sizes: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n)) for n in sizes]


def test_buckets_follow_backward_order_and_pad_to_the_data_parallel_size():
    a, b, c, d = params(10, 7, 5, 3)
    offsets, buckets, total = plan_buckets([a, b, c, d], late=[], bucket_size=8, size=4)
    # reverse registration order; a bucket closes once it holds at least 8 elements: d + c, then b + a
    assert [[p.numel() for p in bk.params] for bk in buckets] == [[3, 5], [7, 10]]
    assert [(bk.start, bk.end) for bk in buckets] == [(0, 8), (8, 28)]  # 17 padded to 20
    assert (offsets[id(d)], offsets[id(c)], offsets[id(b)], offsets[id(a)]) == (0, 3, 8, 15)
    assert total == 28 and all((bk.end - bk.start) % 4 == 0 for bk in buckets)


def test_late_parameters_trail_in_buckets_of_their_own():
    a, b, c = params(4, 4, 4)
    _, buckets, _ = plan_buckets([a, b, c], late=[a], bucket_size=100, size=2)
    assert [([p is a for p in bk.params], bk.late) for bk in buckets] == [([False, False], False), ([True], True)]


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_shards_partition_every_bucket(size):
    ps = params(13, 2, 31, 6, 1)
    _, buckets, total = plan_buckets(ps, late=ps[:1], bucket_size=16, size=size)
    covered = sorted(i for bk in buckets for r in range(size) for i in range(*bk.shard(r, size)))
    assert covered == list(range(total))


def test_single_rank_reducer_keeps_gradients_in_one_buffer_and_reports_its_pieces():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    trained = list(model.parameters())
    reducer = GradientReducer(trained, group=RankGroup.solo(), bucket_size=10)
    model(torch.ones(5, 3)).sum().backward()
    reducer.finish()
    for p in trained:
        assert p.grad.data_ptr() == reducer.view(reducer.grad_buffer, p).data_ptr()
    assert sum(z - a for _, a, z, _ in reducer.local_pieces()) == sum(p.numel() for p in trained)
    reducer.reset()
    assert reducer.grad_buffer.abs().sum() == 0
