"""Building a layout allocates only the rank's part of every weight: each rank fills its shards from
the blocks of every tensor's single-device init that meet them, one block at a time, never a whole
tensor. Measured by the process's peak resident memory from the start of `parallelize` to the end of
its weights' initialization (Linux's high-water mark, reset at the start), at ZeRO-3 (data-parallel
rows) and under tensor parallelism, against the shards plus a block; the weights are the
single-device ones."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.distributed.topology import Axis, ParallelDims, Topology
from paratron.model import init
from paratron.model.gpt import GPT, build_model
from paratron.parallel.data_parallel.fully_sharded import full_parameter, local_tensor
from paratron.parallel.sharding import gather_full

transform = importlib.import_module("paratron.parallel.parallelize")  # (the module: the package exports its function)

WIDE = dict(
    num_layers=4,
    hidden_size=768,
    num_attention_heads=8,
    vocab_size=8100,
    max_position_embeddings=64,
    untie_embeddings_and_output_weights=True,
)
"""About 24M parameters: 94 MB in fp32, a whole stage well above one rank's half. The output layer,
25 MB, is larger than the bound on what a rank may allocate beside its shards, and is initialized
last, when the other shards are resident (a page counts once written). The vocabulary is padded
under tensor parallelism."""

BLOCK = 2**16
"""The init block of these tests (in elements; set on `model.init` in every process): the real one,
16 MiB, is larger than this model's tensors, whose blocks would then be whole tensors."""

SLACK = 16 * 2**20
"""The allocator's and the process groups' growth beside the weights."""


def _memory(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> int:
    """Reset the peak resident memory to the current one; returns it."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _memory("VmRSS")


def _noting_peak(materialize: Callable, peaks: list[int]) -> Callable:
    def run(*args: Any) -> None:
        materialize(*args)
        peaks.append(_memory("VmHWM"))

    return run


def build_layout(settings: dict) -> dict:
    """Build this rank's part of WIDE at `settings`; returns the peak's growth up to the end of the
    weights' initialization, the shards' bytes and every weight assembled whole."""
    init.INIT_BLOCK_ELEMENTS = BLOCK
    initialize("gloo")
    config = build_config(dict(WIDE, seed=11, **settings), recipe="debug")
    topology = Topology(
        ParallelDims(dist.get_world_size(), tp=config.parallel.tensor_model_parallel_size), dist.get_rank()
    )
    topology.create_groups()
    with torch.device("meta"):
        meta = GPT(dataclasses.replace(config.model))
    peaks: list[int] = []  # (what follows the weights' initialization, the gradients' buffers, is not measured)
    transform.materialize = _noting_peak(transform.materialize, peaks)
    transform.materialize_shards = _noting_peak(transform.materialize_shards, peaks)
    before = _reset_peak()
    model = transform.parallelize(
        meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
    )
    grown = peaks[0] - before
    params = dict(model.module.named_parameters())
    shards = sum(local_tensor(p).numel() * 4 for p in params.values())
    if topology.size(Axis.TP) > 1:
        whole = {name: gather_full(p, topology.group(Axis.TP)).clone() for name, p in params.items()}  # collective
    else:
        assert topology.group(Axis.DP).size == 2
        whole = {name: full_parameter(p).detach().clone() for name, p in params.items()}  # collective
    return {"grown": grown, "shards": shards, "whole": whole}


PADDED = ("embedding.weight", "output.weight")


def _check(results: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init, "INIT_BLOCK_ELEMENTS", BLOCK)
    config = build_config(dict(WIDE, seed=11), recipe="debug")
    reference = dict(build_model(config.model, "cpu", seed=11).named_parameters())
    stage = sum(p.numel() * 4 for p in reference.values())
    bound = 2 * BLOCK * 4 + SLACK
    assert max(p.numel() * 4 for p in reference.values()) > bound  # (a whole tensor at a time would not fit)
    for rank in results:
        assert rank["shards"] <= stage / 2 + 2**20  # (halves, and what every rank holds whole)
        # the peak grows by the shards, a block and the allocator's slack, never by a whole tensor
        assert rank["grown"] < rank["shards"] + bound, (rank["grown"], rank["shards"], stage)
        for name, value in rank["whole"].items():
            expected = reference[name].detach()
            if value.shape != expected.shape:  # (the vocabulary padded on one process: its rows start at zero)
                assert name in PADDED and not value[expected.size(0) :].any(), name
                value = value[: expected.size(0)]
            torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)


def test_zero3_builds_only_its_shards_with_the_single_device_weights(monkeypatch):
    _check(run_ranks(build_layout, 2, dict(zero_stage=3)), monkeypatch)


def test_tensor_parallel_builds_only_its_slices_with_the_single_device_weights(monkeypatch):
    _check(run_ranks(build_layout, 2, dict(tensor_model_parallel_size=2)), monkeypatch)
