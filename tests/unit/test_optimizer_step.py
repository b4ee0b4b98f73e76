"""The optimizer step on the device's fast path (foreach on the CPU, fused on CUDA) computes, bit for bit,
what torch's per-tensor loop computed before: over weight-decay groups and decoupled learning rates, for AdamW
and SGD, for plain tensors, the distributed optimizer's pieces and FSDP2's DTensor shards, and after a state
dict saved by the loop is loaded."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.config.schema import OptimizerConfig
from paratron.distributed.fake import fake_world
from paratron.distributed.topology import ParallelDims, RankGroup, Topology
from paratron.model.gpt import GPT
from paratron.optim.build import build_optimizer
from paratron.optim.distributed import DistributedOptimizer
from paratron.optim.master_weights import (
    FullyShardedOptimizer,
    ReplicatedOptimizer,
    make_inner_optimizer,
    optimizer_groups,
    step_counter,
    step_implementation,
)
from paratron.parallel import parallelize

SHAPES = [(96, 80), (80,), (333, 129), (7,), (1, 1), (4, 5, 6)]
"""Matrices (decayed) and vectors (not), of sizes above and below the kernels' vector widths."""
STEPS = 5
KERNEL_KEYS = ("params", "foreach", "fused")
"""Group keys a copied group leaves out: a group's own foreach / fused flags override the optimizer's."""
TINY = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, max_position_embeddings=16
)


def _params(seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _grads(step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in like]


def _with_schedule(groups: list[dict]) -> list[dict]:
    """Each group's rate as the schedule sets it: the decoupled groups at their own peak."""
    for group in groups:
        group["lr"] = group.get("max_lr", 3e-3)
    return groups


def _loop(groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The step paratron took before: torch's per-tensor loop."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, foreach=False, fused=False)
    betas = (config.adam_beta1, config.adam_beta2)
    return torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.adam_eps, foreach=False, fused=False)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_fast_step_equals_the_loop_bit_for_bit(optimizer: str) -> None:
    config = OptimizerConfig(optimizer=optimizer, weight_decay=0.1, adam_beta2=0.95, decoupled_lr=1e-2)
    old, new = _params(), _params()
    decoupled = {id(old[0]), id(old[3])}  # a matrix and a vector take the decoupled rate
    old_groups = _with_schedule(optimizer_groups(old, old, config, decoupled))
    new_groups = _with_schedule(optimizer_groups(old, new, config, decoupled))  # same positions, other tensors
    assert len(new_groups) == 4 and {g["lr"] for g in new_groups} == {3e-3, 1e-2}
    reference, fast = _loop(old_groups, config), make_inner_optimizer(new_groups, config)
    assert fast.defaults["foreach"] is True and fast.defaults["fused"] is False  # CPU tensors: foreach
    for step in range(STEPS):
        for params in (old, new):
            for param, grad in zip(params, _grads(step, params)):
                param.grad = grad
        reference.step()
        fast.step()
        for a, b in zip(old, new):
            assert torch.equal(a, b), (optimizer, step, a.shape)
    assert not torch.equal(old[0], _params()[0])  # the weights did move


def test_the_implementation_follows_the_masters_device() -> None:
    assert step_implementation([torch.zeros(3)]) == {"foreach": True, "fused": False}
    assert step_implementation([]) == {"foreach": True, "fused": False}
    assert step_implementation([torch.zeros(3, device="meta")]) == {"foreach": True, "fused": False}
    # the step count sits where the kernels read it: on the CPU for the loop and foreach
    plain = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], foreach=True)
    counter = step_counter(plain, plain.param_groups[0]["params"][0], 7)
    assert counter.device.type == "cpu" and counter.dtype == torch.float32 and counter.item() == 7.0


def test_a_state_saved_by_the_loop_loads_and_steps_alike() -> None:
    """torch's load_state_dict takes the saved groups' foreach / fused flags: the optimizer keeps its own."""
    config = OptimizerConfig(weight_decay=0.1)
    old = _params()
    reference = _loop(optimizer_groups(old, old, config), config)
    for step in range(2):
        for param, grad in zip(old, _grads(step, old)):
            param.grad = grad
        reference.step()
    new = [nn.Parameter(p.detach().clone()) for p in old]
    grads = {id(p): torch.zeros_like(p) for p in new}  # the main gradients the masters' gradients point at
    replicated = ReplicatedOptimizer(new, lambda p: grads[id(p)], config, RankGroup.solo(), lambda p: 1.0)
    replicated.load_state_dict(copy.deepcopy(reference.state_dict()))  # (else it shares the state tensors)
    assert all(g["foreach"] is True and g["fused"] is False for g in replicated.param_groups)
    for step in range(2, STEPS):
        for param, twin, grad in zip(old, new, _grads(step, old)):
            param.grad, grads[id(twin)] = grad, grad.clone()
        replicated.prepare_grads()
        reference.step()
        replicated.step()
        assert all(torch.equal(a, b) for a, b in zip(old, new)), step


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_model_optimizers_step_foreach_and_equal_the_loop(zero_stage: int) -> None:
    """ZeRO-0's masters are the parameters; ZeRO-1's are views into the flat buffer."""
    config = build_config(dict(TINY, zero_stage=zero_stage, weight_decay=0.1))
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1))
    optimizer = build_optimizer(model, config.optimizer)
    assert isinstance(optimizer, DistributedOptimizer if zero_stage else ReplicatedOptimizer)
    _assert_steps_equal_the_loop(optimizer, config.optimizer)


def test_fsdp_dtensor_shards_step_foreach_and_equal_the_loop() -> None:
    """ZeRO-3 on a fake world of two ranks: the masters are FSDP2's fp32 DTensor shards."""
    config = build_config(dict(TINY, zero_stage=3, weight_decay=0.1))
    with fake_world(2, 0):
        topology = Topology(ParallelDims(2), 0)
        topology.create_groups()
        with torch.device("meta"):
            meta = GPT(config.model)
        model = parallelize(
            meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
        )
        optimizer = build_optimizer(model, config.optimizer)
        assert isinstance(optimizer, FullyShardedOptimizer)
        assert all(isinstance(m, DTensor) for m in optimizer.masters)
        _assert_steps_equal_the_loop(optimizer, config.optimizer)
        del model


def _assert_steps_equal_the_loop(optimizer, config: OptimizerConfig) -> None:
    """Step `optimizer` and a per-tensor loop over copies of its masters with the same gradients."""
    assert all(g["foreach"] is True and g["fused"] is False for g in optimizer.param_groups)
    copies = {id(m): nn.Parameter(m.detach().clone()) for m in optimizer.masters}
    groups = [
        {**{k: v for k, v in g.items() if k not in KERNEL_KEYS}, "params": [copies[id(m)] for m in g["params"]]}
        for g in optimizer.param_groups
    ]
    reference = _loop(groups, config)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for master in optimizer.masters:
            grad = _like(master, generator)
            master.grad, copies[id(master)].grad = grad, grad.clone()
        optimizer.step()
        reference.step()
        for master in optimizer.masters:
            assert torch.equal(_local(master), _local(copies[id(master)])), step


def _like(master: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random gradient for `master`, as a DTensor of the same layout where it is one."""
    if isinstance(master, DTensor):
        local = torch.randn(master.to_local().shape, generator=generator)
        return DTensor.from_local(
            local, master.device_mesh, master.placements, shape=master.shape, stride=master.stride()
        )
    return torch.randn(master.shape, generator=generator)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
