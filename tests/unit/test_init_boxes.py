"""Each rank's part of a weight is filled from the blocks of the single-device init that meet it:
tensor-parallel rows with vocabulary padding, column blocks (gate and up), experts, all equal to
that part cut from the whole init, in one process with hand-made records."""

from __future__ import annotations

import pytest
import torch

from paratron.model import init
from paratron.parallel.parallelize import fill_from_init
from paratron.parallel.sharding import ParamInfo, Shard, set_info, take_slice

from tiny import GPT_FLAVOUR

PARTS = {
    "vocabulary rows, padded": ("embedding.weight", (97, 32), ParamInfo(shard=Shard(0, 49, 48, 97)), (52, 32)),
    "columns of two blocks": (
        "layers.0.mlp.in_proj.up.weight",
        (97, 32),
        ParamInfo(shard=Shard(1, 4, 8, 32, blocks=2)),
        (97, 16),
    ),
    "experts and columns": (
        "layers.0.mlp.experts.w_out",
        (4, 16, 8),
        ParamInfo(shard=Shard(2, 4, 4, 8), expert_shard=Shard(0, 1, 2, 4)),
        (2, 16, 4),
    ),
}


@pytest.mark.parametrize("part", PARTS)
def test_a_rank_part_equals_that_part_of_the_whole_init(part, monkeypatch):
    monkeypatch.setattr(init, "INIT_BLOCK_ELEMENTS", 64)  # (two rows of a 97 x 32 matrix per block)
    name, shape, record, local_shape = PARTS[part]
    whole = torch.empty(shape)
    init.init_parameter(name, whole, GPT_FLAVOUR, seed=3)
    param = torch.nn.Parameter(torch.full(local_shape, float("nan")))
    set_info(param, record)
    fill_from_init(name, param, GPT_FLAVOUR, seed=3)
    assert torch.equal(param.detach(), take_slice(whole, param))  # (padding zero)
