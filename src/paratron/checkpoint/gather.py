"""A model's checkpointed state as the ranks hold it: the buffers that belong in a checkpoint beside
the parameters, which replica stands for its data-parallel peers, and the whole weights gathered from
the ranks' slices (the closing sample of a run, tests)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratron.distributed.topology import Axis, Topology
from paratron.parallel.data_parallel.fully_sharded import full_parameter
from paratron.parallel.sharding import gather_full, param_info


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """State that is not a parameter but belongs in a checkpoint (a MoE router's expert bias)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def first_replica(topology: Topology) -> bool:
    """The first of the ranks that hold the same model part (data- and context-parallel peers)."""
    return topology.local_rank(Axis.DP_CP) == 0


def _stage_writer(topology: Topology) -> bool:
    """The rank that writes its pipeline stage's weights: the stage's first tensor-, context- and
    data-parallel rank."""
    return first_replica(topology) and topology.tp_rank == 0


def full_state(model: nn.Module, topology: Topology, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter this rank's stage holds, once (a tied output weight appears as the
    embedding; the last pipeline stage's copy of it is left to the first), whole and on the CPU:
    tensor-parallel slices (and experts held by other expert-parallel ranks) are gathered one
    tensor at a time (collective over those groups; ranks with keep=False take part and keep nothing)."""
    out = {}
    tp_group, ep_group, etp_group = topology.group(Axis.TP), topology.group(Axis.EP), topology.group(Axis.EXPERT_TP)
    for name, param in model.named_parameters():
        if param_info(param).pipeline_duplicate:
            continue
        full = gather_full(param, tp_group, full_parameter(param), ep_group, etp_group)
        if keep:
            out[name] = full.cpu()
    if keep:
        out.update({name: buffer.detach().cpu() for name, buffer in persistent_buffers(model).items()})
    return out


def whole_model_state(model: nn.Module, topology: Topology) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (empty elsewhere): each pipeline stage's, gathered over
    tensor parallelism, sent to it. Collective over the tensor-parallel group; the stage writers
    also take part over the pipeline-parallel group."""
    stage_writer, main = _stage_writer(topology), topology.rank == 0
    state = full_state(model, topology, keep=stage_writer)
    pp = topology.group(Axis.PP)
    if pp.size == 1 or not stage_writer:
        return state if main else {}
    stages: list[Any] = [None] * pp.size
    dist.gather_object(state, stages if main else None, dst=0, group=pp.process_group)
    return {name: t for part in stages for name, t in part.items()} if main else {}
