"""ZeRO stage 3: parameters, gradients and optimizer state all sharded over the data-parallel
group, with PyTorch FSDP2 (`fully_shard`).

Each transformer block is one unit (its parameters are gathered just before it runs and freed
after); the root unit holds the rest (embedding, final norm, output layer), so a tied
embedding stays in a single unit. Under pipeline parallelism the root is the stage runner,
whose forward runs one chunk of this rank's stages.

FSDP2 averages gradients over the data-parallel group; gradients that are partial sums over
another group (tensor- or pipeline-parallel copies) are completed afterwards on the local
shards (`DataParallel._finish_sharded`), which line up because every member of such a group
shards a tensor of the same shape the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratron.model.gpt import GPT


def shard_fully(model: GPT, group: Any, device: torch.device, root: nn.Module | None = None,
                compute_dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """Apply FSDP2 over `group` to this rank's part of `model` (materialized, fp32); returns the units.
    `root` is the module whose forward runs the model (default `model`; a pipeline stage's runner).
    With a 16-bit `compute_dtype` the fp32 shards are the master weights: FSDP2 gathers them in
    that type for compute and reduces gradients in fp32."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    root = model if root is None else root
    mesh = DeviceMesh.from_group(group, device.type)
    tags = {id(p): {k: v for k, v in p.__dict__.items() if k in _TAGS} for p in model.parameters()}
    before = {id(m): list(m.parameters(recurse=False)) for m in model.modules()}
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    units: list[Any] = []
    for block in model.layers:
        if block is not None:
            fully_shard(block, mesh=mesh, mp_policy=policy)
            units.append(block)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    units.append(root)
    keep_tags(list(model.modules()), tags, before)
    return units


_TAGS = ("shard", "shard_layout", "partial_grad_group", "pipeline_duplicate")
"""The attributes parallel layers tag parameters with (see `parallel/sharding.py`)."""


def _is_sharded(tensor: Any) -> bool:
    return hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh")


def keep_tags(units: list[nn.Module], tags: dict[int, dict[str, Any]], before: dict[int, list[nn.Parameter]]) -> None:
    """FSDP2 replaces each parameter with a sharded one; give it the old one's tags (`shard`, ...)."""
    for unit in units:
        for new, old in zip(unit.parameters(recurse=False), before[id(unit)]):
            new.__dict__.update(tags[id(old)])


def full_parameter(param: torch.Tensor) -> torch.Tensor:
    """The whole (tensor-parallel-local) tensor of a parameter; collective over the data-parallel
    group when the parameter is FSDP-sharded."""
    return param.full_tensor() if _is_sharded(param) else param  # type: ignore[attr-defined]


@torch.no_grad()
def assign_full(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set a parameter from its whole (tensor-parallel-local) value; an FSDP-sharded one keeps
    its chunk of dim 0 (FSDP2 shards as `torch.chunk` does)."""
    if not _is_sharded(param):
        param.copy_(value)
        return
    local = param.to_local()  # type: ignore[attr-defined]
    mesh = param.device_mesh  # type: ignore[attr-defined]
    chunks = value.chunk(mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    if rank < len(chunks) and local.numel():
        local.copy_(chunks[rank])
