"""ZeRO stage 3: parameters, gradients and optimizer state all sharded over the data-parallel
group, with PyTorch FSDP2 (`fully_shard`).

Each transformer block is one unit (its parameters are gathered just before it runs and freed
after); the root unit holds the rest (embedding, final norm, output layer), so a tied
embedding stays in a single unit. Under pipeline parallelism the root is the stage runner,
whose forward runs one chunk of this rank's stages.

A MoE layer's experts live on a grid of their own (`distributed.topology`): when their
expert-data-parallel ranks are not the data-parallel ones, the experts of each block are a unit
of their own, sharded over the expert-data-parallel group, whose gradients are summed over it and
divided by the data-parallel size (every token of the stage counted once, averaged over the
data-parallel replicas as the dense gradients are).

FSDP2 averages gradients over the data-parallel group; gradients that are partial sums over
another group (tensor- or pipeline-parallel copies) are completed afterwards on the local
shards (`DataParallelGradients.finish`), which line up because every member of such a group
shards a tensor of the same shape the same way.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from paratron.distributed.topology import RankGroup
from paratron.model.gpt import GPT
from paratron.model.moe import Experts, MoELayer
from paratron.parallel.sharding import Index, bounded, copy_info, full_shape, place

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# FSDP2 and DTensor are imported where a model is sharded (start-up speed: docs/architecture.md). Until then no
# tensor or module can be theirs, which is how the checks below answer without importing them.
_FSDP, _DTENSOR = "torch.distributed.fsdp", "torch.distributed.tensor"


def _is_fsdp_unit(module: nn.Module) -> bool:
    fsdp = sys.modules.get(_FSDP)
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def shard_fully(
    model: GPT,
    group: RankGroup,
    device: torch.device,
    root: nn.Module | None = None,
    compute_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    expert_group: RankGroup | None = None,
) -> list[nn.Module]:
    """Apply FSDP2 over `group` to this rank's part of `model` (materialized, fp32); returns the units.
    `root` is the module whose forward runs the model (default `model`; a pipeline stage's runner).
    With a 16-bit `compute_dtype` the fp32 shards are the master weights: FSDP2 gathers them in
    that type for compute and reduces gradients in `reduce_dtype` (fp32, or bf16 under --grad-reduce-in-bf16),
    then keeps each rank's gradient shard in fp32 beside its fp32 weight shard. `expert_group`: the
    experts' expert-data-parallel group, when it is not `group` (each block's experts a unit over it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # (start-up speed: docs/architecture.md)

    root = model if root is None else root
    # (a model on the meta device, as --dry-run builds, keeps its shards there; the mesh needs a real device type)
    meshes = _Meshes("cpu" if device.type == "meta" else device.type)
    mesh = meshes.of(group)
    before = {id(m): list(m.parameters(recurse=False)) for m in model.modules()}
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    units: list[nn.Module] = []
    for block in model.layers:
        if block is None:
            continue
        moe = block.kind_of(MoELayer)
        experts = moe.experts if moe is not None else None
        if expert_group is not None and isinstance(experts, Experts):
            fully_shard(experts, mesh=meshes.of(expert_group), mp_policy=policy)
            experts.set_gradient_divide_factor(float(group.size))  # type: ignore[operator]
            # (a sum, then the division: gloo has no pre-multiplied sum; alone on its rank FSDP2 divides by itself)
            experts.set_force_sum_reduction_for_comms(expert_group.size > 1)  # type: ignore[operator]
            units.append(experts)
        fully_shard(block, mesh=mesh, mp_policy=policy)
        units.append(block)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    units.append(root)
    for unit in model.modules():  # FSDP2 replaced each parameter with a sharded one: give it the record
        for new, old in zip(unit.parameters(recurse=False), before[id(unit)]):
            copy_info(old, new)
    return units


class _Meshes:
    """FSDP2's device meshes of rank groups. A group of this rank alone has no process group of
    its own, which a mesh needs: every rank then makes its own at once (collective)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.alone: dist.ProcessGroup | None = None

    def of(self, group: RankGroup) -> DeviceMesh:
        process_group = group.process_group
        if process_group is None:
            if self.alone is None:
                self.alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
            process_group = self.alone
        from torch.distributed.device_mesh import DeviceMesh  # (start-up speed: docs/architecture.md)

        return DeviceMesh.from_group(process_group, self.device_type)


def reshard(module: nn.Module) -> None:
    """Put FSDP2's sharded parameters back after forwards without a backward (an evaluation): the
    root unit keeps its gathered ones after a forward, expecting the backward, and those are not
    the parameters the optimizer and checkpoints hold. No-op without FSDP2."""
    for unit in module.modules():
        if _is_fsdp_unit(unit):
            unit.reshard()  # type: ignore[operator]


def gather_for_use(unit: nn.Module) -> None:
    """Make an FSDP2 unit's parameters whole for work that reads them outside its forward, before its backward (the
    fused loss reads the root unit's output weight after the model's forward): autograd then accumulates their
    gradients on the gathered parameters, which the unit's post-backward reduce-scatters into its shards as for
    any gradient of its forward. No-op when they are gathered already (the root keeps them so after a forward) or
    without FSDP2."""
    if _is_fsdp_unit(unit):
        unit.unshard()  # type: ignore[operator]


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is FSDP2's sharded form (a DTensor) of a parameter, gradient or state."""
    dtensor = sys.modules.get(_DTENSOR)
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's sharded tensors), or the tensor itself; a one-tensor wrapper
    (torchao's fp8 weights under --fp8-param-gather) gives the plain tensor it wraps, whose storage is the
    parameter's."""
    local = tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]
    while is_traceable_wrapper_subclass(local):
        inner, _ = local.__tensor_flatten__()
        if len(inner) != 1:
            break
        local = getattr(local, inner[0])
    return local


def full_parameter(param: torch.Tensor) -> torch.Tensor:
    """The whole (tensor-parallel-local) tensor of a parameter; collective over the data-parallel
    group when the parameter is FSDP-sharded."""
    return param.full_tensor() if is_sharded(param) else param  # type: ignore[attr-defined]


def fsdp_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of dimension 0 of its (tensor-parallel-local) tensor that this rank
    holds of an FSDP-sharded parameter; None when the parameter is not sharded."""
    if not is_sharded(param):
        return None
    # (start-up speed: docs/architecture.md; loaded with the DTensor `param` is)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)  # type: ignore[attr-defined]
    if not shape:
        return 0, 0
    return int(offset[0]), int(offset[0]) + int(shape[0])


def held_boxes(param: torch.Tensor) -> list[tuple[Index, Index]]:
    """What this rank holds of a parameter: (index into the single-device tensor, index into
    `local_tensor(param)`) pairs, every slice with explicit bounds; its tensor-parallel and
    expert-parallel boxes (`sharding.place`), cut to its FSDP2 rows under ZeRO-3."""
    shape = full_shape(param)
    pairs = [(bounded(whole, shape), bounded(mine, tuple(param.shape))) for whole, mine in place(param)]
    rows = fsdp_rows(param)
    if rows is None:
        return pairs
    out = []
    for whole, mine in pairs:
        start, stop = max(mine[0].start, rows[0]), min(mine[0].stop, rows[1])
        if start >= stop:
            continue
        shift = whole[0].start - mine[0].start
        out.append(
            (
                (slice(start + shift, stop + shift), *whole[1:]),
                (slice(start - rows[0], stop - rows[0]), *mine[1:]),
            )
        )
    return out
